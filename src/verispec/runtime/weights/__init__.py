"""Weights as stored and placed: a GGUF file's header (`gguf_file`) and its tensors by Hugging Face name (`gguf`), huge
pages (`hugepages`)."""
