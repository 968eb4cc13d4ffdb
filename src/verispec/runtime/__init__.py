"""The runtime layer, below the engine and the drafters: the KV cache (`kv_cache.py`), verispec's own Llama-family
model (`llama.py`), and the runners that execute forward passes on slots (`runner.py`: the interface and the
Hugging Face runner; `native.py`: the native runner). The engine and the drafters import it; it imports neither."""
