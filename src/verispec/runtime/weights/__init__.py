"""Weights as stored and placed: a GGUF file's tensors by Hugging Face name (`gguf`), huge pages (`hugepages`)."""
