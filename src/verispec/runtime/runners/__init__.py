"""The runners: one interface (`base.SlotRunner.forward` on slots, rollback as bookkeeping) over Hugging Face
modeling (`hf.HFRunner`) and verispec's own model (`native.NativeRunner`); `select.make_runner` picks one."""
