"""The target and draft models: verispec's own Llama-family model (`llama`), models only the native runner runs
(`native_lm`: a GGUF file's blocks, plain Llama drafts), loading models and the embedded default (`loading`), the
target's weights decided and loaded (`target`), tokenizers (`tokenizer_cache`), and how much memory they and their
caches take (`memory`)."""
