"""A preallocated KV cache whose rollback is bookkeeping: `truncate(n)` moves a length pointer.

Each layer owns buffers of shape [batch, kv_heads, max_len, head_dim], allocated on the first forward.
Invariant: positions [0, length) of every layer hold the keys/values of the tokens the runner has fed and kept;
anything at or past `length` is stale and is overwritten by the next forward before it is ever attended to,
because `update` returns views of [0, length + new) only. So a rejected draft costs nothing to discard.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PointerLayer(CacheLayerMixin):
    """One attention layer's KV buffers plus the shared-by-convention length pointer."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, k_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(batch, heads, self.max_len, k_dim)  # [batch, kv_heads, max_len, head_dim]
        self.values = value_states.new_zeros(batch, heads, self.max_len, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [batch, kv_heads, new, head_dim]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        assert end <= self.max_len, f"KV cache overflow: {end} > max_len {self.max_len}"
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Called before `update` in a forward: the keys attended to are the kept prefix plus the new queries.
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.max_len

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        self.length = max(0, self.length - abs(tokens_to_remove))


class PointerCache(Cache):
    """A `transformers` Cache of `PointerLayer`s: O(1) truncation for speculative rollback."""

    def __init__(self, num_layers: int, max_len: int) -> None:
        super().__init__(layers=[PointerLayer(max_len) for _ in range(num_layers)])
        self.max_len = max_len

    @property
    def length(self) -> int:
        return self.layers[0].length

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions. Rollback only: the kept prefix is never rewritten."""
        assert 0 <= length <= self.length, f"cannot truncate a cache of {self.length} to {length}"
        for layer in self.layers:
            layer.length = length

    def reset(self) -> None:
        self.truncate(0)
