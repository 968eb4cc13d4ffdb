"""Min-of-48 ms per decode step and per 5-token verify pass of the embedded default, the C++ layer kernels
(runtime/kernels/fused.py) off/on x batch-invariant off/on, interleaved in one process; then aten calls per decode step.

    PYTHONPATH=src python recipes/layer_kernels_steps.py THREADS float32,bfloat16
"""
import time, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from torch.profiler import profile, ProfilerActivity
from verispec.runtime.model.loading import SMOLLM2_TARGET, load_model
from verispec.runtime.kernels import fused
from verispec.runtime.runners.native import NativeRunner
prompt = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 1041, 45, 2, 198]])
runners = {}
for name in sys.argv[2].split(","):
    hf = load_model(SMOLLM2_TARGET, dtype=getattr(torch, name))
    for inv in (False, True):
        runners[name, inv] = NativeRunner.from_hf(hf, 2048, batch_invariant=inv)
best = {}
for rep in range(4):
    for (name, inv), r in runners.items():
        for on in (False, True):
            fused.ENABLED = on
            r.reset(); out = r.forward(prompt, last_only=True)
            tok = out.logits[0, -1].argmax().view(1, 1)
            for _ in range(12):
                t = time.perf_counter(); out = r.forward(tok); e = time.perf_counter() - t
                tok = out.logits[0, -1].argmax().view(1, 1)
                k = (name, inv, on, "decode"); best[k] = min(best.get(k, 9), e)
            base = r.cache.lengths[0]
            for _ in range(12):
                t = time.perf_counter(); r.forward(prompt[:, :5]); e = time.perf_counter() - t
                r.truncate(base)
                k = (name, inv, on, "verify5"); best[k] = min(best.get(k, 9), e)
for k, v in sorted(best.items()):
    print(k, f"{v*1e3:.2f} ms", flush=True)
for (name, inv), r in runners.items():
    if inv: continue
    for on in (False, True):
        fused.ENABLED = on
        r.reset(); r.forward(prompt, last_only=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(8): r.forward(prompt[:, :1])
        ev = prof.key_averages()
        print(name, "kernels", on, "aten calls per step", sum(e.count for e in ev if e.key.startswith("aten::")) / 8, flush=True)
