"""KV caches: one slot per running sequence (`kv_cache.SlotCache`) and the prompt-prefix cache (`prefix_cache`)."""
