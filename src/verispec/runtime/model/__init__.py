"""The target and draft models: verispec's own Llama-family model (`llama`), loading models, tokenizers and the
embedded default (`loading`), and how much memory they and their caches take (`memory`)."""
