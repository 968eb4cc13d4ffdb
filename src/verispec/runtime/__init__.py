"""The runtime layer, below the drafters and the engine (they import it; it imports neither), in five rooms:

- `kernels/`: verispec's C++ kernels, each beside its Python binding (`dense`, `fused` (attention and the small
  ops), `layer_loop`, `quant`), `ext.py` that builds them, and `invariant.py`, the torch fallback where none builds.
- `runners/`: what executes forward passes on slots: `base` (what every runner shares), `hf` (`HFRunner`, Hugging
  Face modeling), `native` (`NativeRunner`, verispec's own model), `select` (`make_runner` picks one), `compile`
  (torch.compile's precompiled step), `dtype` (`--dtype auto`).
- `model/`: verispec's own Llama-family model (`llama`), models only the native runner runs (`native_lm`: a GGUF
  file's blocks, plain Llama drafts, without Hugging Face modeling), loading models (`loading`), the target's
  weights decided and loaded (`target`), tokenizers (`tokenizer_cache`), and their memory (`memory`).
- `caches/`: the slot KV cache (`kv_cache`) and automatic prefix caching (`prefix_cache`).
- `weights/`: weight formats and placement: a GGUF file's header (`gguf_file`) and tensors (`gguf`), 2 MiB huge
  pages (`hugepages`).
"""
