"""The runtime layer, below the engine and the drafters: the KV cache (`kv_cache.py`), verispec's own Llama-family
model (`llama.py`), and the runners that execute forward passes on slots (`base.py`: what every runner shares;
`hf_runner.py`: Hugging Face modeling; `native.py`: the native runner; `runner.py`: `make_runner` picks one).
The engine and the drafters import it; it imports neither."""
