"""A preallocated KV cache of slots, one per running sequence; rollback is bookkeeping (a length per slot).

Each layer owns buffers of shape [slots, kv_heads, max_len, head_dim], allocated on the first forward and grown
(up to num_slots) when a forward first uses a higher slot, so memory follows the largest batch run. Slot s holds
the keys/values of one sequence at its own positions 0, 1, 2, ... (cache index = index in the fed token stream).

Invariant (per slot s): entries [0, lengths[s]) hold the keys/values of the tokens fed and kept for that
sequence; everything at or past lengths[s] is stale. A forward over slots [start, start + batch) writes its n
new entries of row b at lengths[start + b] + t (t = 0..n-1) and attends over [0, kv_len) under a 4D mask that
hides every stale entry (see `attention_mask`), so stale entries (rejected drafts, padding of shorter rows) are
never attended to and are overwritten by later forwards. Discarding rejected tokens moves a length back.

Rings (sliding-window layers, `NativeRunner` on Gemma 3): such a layer keeps R = window + slack entries a slot
(slack: the most tokens one forward writes a row; wider forwards run in pieces), cache index i at ring index
i mod R. Ring index j holds the largest cache index below the slot's written length congruent to j (`ring_mask`
gathers the runner's mask onto the ring that way; nothing there yet: hidden). Invariant: R >= window + n - 1 for
a forward of n tokens a row, so no entry a fed query may see (its window) was overwritten in that forward, and a
rollback stays bookkeeping: the rejected tokens overwrote only entries older than the window of every later
query. Slot moves copy the ring as it is (the same cache indices map to the same ring indices); `keep_path`
moves entries ring-aware. A layer without a ring keeps every entry (Llama models, global layers).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..weights import hugepages


class SlotLayer(CacheLayerMixin):
    """One attention layer's KV buffers; the write positions of a forward come from the parent `SlotCache`."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: SlotCache, ring: int | None = None) -> None:
        super().__init__()
        self.cache = cache
        self.ring = ring  # entries of a ring (cache index i at i mod ring: module docstring), None: every entry

    @property
    def capacity(self) -> int:
        """Entries a slot's buffer holds: the ring's, else max_len."""
        return self.ring or self.cache.max_len

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(0, key_states.shape[1], self.capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(0, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _grow(self, slots: int) -> None:
        """Buffers for at least `slots` slots (doubling, up to num_slots): memory follows the largest batch seen,
        and a slot's entries never move when the buffers grow. keys, values: [slots, kv_heads, capacity, dim]."""
        size = min(max(slots, 2 * self.keys.shape[0]), self.cache.num_slots)
        keys = hugepages.zeros((size, *self.keys.shape[1:]), self.keys.dtype, self.keys.device)  # streamed every step
        values = hugepages.zeros((size, *self.values.shape[1:]), self.values.dtype, self.values.device)
        keys[: self.keys.shape[0]] = self.keys
        values[: self.values.shape[0]] = self.values
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [batch, kv_heads, n, head_dim], written at the step's per-row cache indices.
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        step = self.cache.step
        batch, heads, n, _ = key_states.shape
        if self.keys.shape[0] < step.start + batch:
            self._grow(step.start + batch)
        rows = slice(step.start, step.start + batch)
        index = entry_index(step.write_index, heads, self.cache.max_len)  # [batch * heads * n]
        write_entries(self.keys[rows], index, key_states)
        write_entries(self.values[rows], index, value_states)
        return self.keys[rows, :, : step.kv_len], self.values[rows, :, : step.kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.step.kv_len, 0  # unused: the runner always passes its own 4D mask

    def get_seq_length(self) -> int:
        return 0  # positions are always passed explicitly; per-row lengths live in SlotCache.lengths

    def get_max_length(self) -> int:
        return self.cache.max_len

    def reset(self) -> None:
        pass

    def keep_path(self, slot: int, base: int, nodes: torch.Tensor) -> None:
        if not self.is_initialized or slot >= self.keys.shape[0]:
            return
        src = base + nodes  # [m]
        if self.ring is None:
            self.keys[slot, :, base : base + nodes.numel()] = self.keys[slot, :, src]
            self.values[slot, :, base : base + nodes.numel()] = self.values[slot, :, src]
            return
        # ring indices: the path's entries (read before any write) to those of base, base + 1, ... (R >= window +
        # the tree's width: none of them is an entry a later query's window still needs)
        dst = (base + torch.arange(nodes.numel(), device=nodes.device)) % self.ring
        self.keys[slot, :, dst] = self.keys[slot, :, src % self.ring]
        self.values[slot, :, dst] = self.values[slot, :, src % self.ring]

    def move(self, src: int, dst: int, length: int) -> None:
        if self.is_initialized and src < self.keys.shape[0]:
            length = min(length, self.capacity)  # a ring: all of it, each entry at the same ring index
            self.keys[dst, :, :length] = self.keys[src, :, :length]
            self.values[dst, :, :length] = self.values[src, :, :length]


def entry_index(write_index: torch.Tensor, heads: int, max_len: int) -> torch.Tensor:
    """Flat row indices into a [batch, heads, max_len, d] buffer seen as [batch * heads * max_len, d] of the
    entries that a forward writing at write_index [batch, n] fills -> [batch * heads * n] (batch, head, t order)."""
    batch, n = write_index.shape
    base = torch.arange(batch * heads, device=write_index.device).view(batch, heads, 1) * max_len  # [b, heads, 1]
    return (base + write_index.view(batch, 1, n)).reshape(-1)


def write_entries(buffer: torch.Tensor, index: torch.Tensor, states: torch.Tensor) -> None:
    """buffer [batch, heads, max_len, d] (contiguous rows of the slot buffers) gets states [batch, heads, n, d] at
    entry_index's flat indices. index_copy_ writes only those entries in the buffer's dtype; `scatter_` on a bf16
    CPU tensor measured ~1,000x slower (it copies the whole buffer through float)."""
    buffer.view(-1, buffer.shape[-1]).index_copy_(0, index, states.reshape(-1, states.shape[-1]).to(buffer.dtype))


class StepLayout:
    """Where one forward writes and how far it attends (set by the runner before each forward)."""

    def __init__(self, start: int, write_index: torch.Tensor, kv_len: int) -> None:
        self.start = start  # first slot of the batch (the batch covers slots [start, start + batch))
        self.write_index = write_index  # [batch, n] long: cache index of each fed token
        self.kv_len = kv_len  # keys attended: [0, kv_len), the longest row's length after the forward


class SlotCache(Cache):
    """A `transformers` Cache of `SlotLayer`s plus the per-slot lengths (host ints: the loop branches on them)."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int,
                 rings: list[int | None] | None = None) -> None:
        """rings: per layer, the entries of its ring (a sliding-window layer), or None (every entry: the default)."""
        self.num_slots = num_slots
        self.max_len = max_len
        self.lengths = [0] * num_slots  # [slot]: kept entries
        self.step: StepLayout | None = None
        super().__init__(layers=[SlotLayer(self, ring) for ring in (rings or [None] * num_layers)])

    @property
    def has_rings(self) -> bool:
        """Whether some layer keeps a ring (its older entries are gone: no prefix can be copied out of it)."""
        return any(layer.ring is not None for layer in self.layers)

    def reserve(self, num_slots: int) -> None:
        if num_slots > self.num_slots:
            self.lengths += [0] * (num_slots - self.num_slots)
            self.num_slots = num_slots

    def set_length(self, slot: int, length: int) -> None:
        """Keep the first `length` entries of a slot. Never claims more than was written (rollback only)."""
        assert 0 <= length <= self.lengths[slot], f"cannot set slot {slot} of {self.lengths[slot]} entries to {length}"
        self.lengths[slot] = length

    def move(self, src: int, dst: int) -> None:
        """Slot src's sequence now lives in slot dst (compaction when a sequence finishes); copies its kept entries."""
        length = self.lengths[src]
        for layer in self.layers:
            layer.move(src, dst, length)
        self.lengths[dst] = length
        self.lengths[src] = 0

    def keep_path(self, slot: int, base: int, nodes: list[int]) -> None:
        """A token tree was written at indices base + node; its accepted path (node indices, root first, increasing)
        moves to base, base + 1, ... and the slot keeps base + len(nodes) entries. Trees only: the one copy of
        rollback, of the accepted entries alone (index_select reads before writing, so overlaps are safe)."""
        assert base + len(nodes) <= self.lengths[slot] and all(a < b for a, b in zip(nodes, nodes[1:]))
        index = torch.tensor(nodes, dtype=torch.long, device=self.layers[0].keys.device
                             if self.layers[0].is_initialized else "cpu")
        for layer in self.layers:
            layer.keep_path(slot, base, index)
        self.lengths[slot] = base + len(nodes)

    def reset(self) -> None:
        self.lengths = [0] * self.num_slots

    def buffers(self, layer: int, slots: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values of slots [0, slots) ([slots, kv_heads, max_len, head_dim] views, in the
        dtype and device of `like` [*, kv_heads, *, head_dim]), made or grown as a forward would: for a model that
        writes its entries itself (drafters/head.py) and then sets the slots' lengths to what they keep."""
        owner = self.layers[layer]
        if not owner.is_initialized:
            proto = like.new_empty(0, like.shape[1], 0, like.shape[-1])
            owner.lazy_initialization(proto, proto)
        if owner.keys.shape[0] < slots:
            owner._grow(slots)
        return owner.keys[:slots], owner.values[:slots]

    def read_entries(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of slot's kept entries [start, end) -> [layers, 2 (keys, values), kv_heads, end - start, head_dim]
        (the prefix cache's copy out, runtime/caches/prefix_cache.py; never on rings)."""
        assert end <= self.lengths[slot], f"slot {slot} keeps {self.lengths[slot]} entries, not {end}"
        assert not self.has_rings, "a ring keeps only its layer's latest entries"
        return torch.stack([torch.stack((layer.keys[slot, :, start:end], layer.values[slot, :, start:end]))
                            for layer in self.layers])

    def write_prefix(self, slot: int, entries: torch.Tensor) -> None:
        """An empty slot gets a cached prefix's entries [layers, 2, kv_heads, n, head_dim] at [0, n) and keeps
        them (the prefix cache's copy in; never on rings); buffers are made or grown as a forward would."""
        assert self.lengths[slot] == 0, f"slot {slot} is not empty"
        assert not self.has_rings, "a ring keeps only its layer's latest entries"
        n = entries.shape[3]
        proto = entries.new_empty(0, entries.shape[2], 0, entries.shape[4])  # [0, kv_heads, 0, head_dim]
        for layer, (keys, values) in zip(self.layers, entries):
            if not layer.is_initialized:
                layer.lazy_initialization(proto, proto)
            if layer.keys.shape[0] <= slot:
                layer._grow(slot + 1)
            layer.keys[slot, :, :n] = keys
            layer.values[slot, :, :n] = values
        self.lengths[slot] = n


def attention_mask(cache_lengths: torch.Tensor, n: int, kv_len: int, dtype: torch.dtype,
                   tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The additive 4D mask of one forward: row b's query t sees its kept prefix [0, cache_lengths[b]) and, among
    the n tokens fed now (at cache indices cache_lengths[b] + u), those with tree_mask[b, t, u] (default causal,
    u <= t). Everything else (stale entries, other rows' padding) is hidden.

    A tree_mask of m > n columns also covers the m - n entries right below the fed ones (cache indices
    cache_lengths[b] - (m - n) + u, an earlier forward's tree nodes): a token tree grown one depth per forward
    (drafters/model_tree.py) lets each node see its own ancestors there, not their siblings; the prefix below
    them is seen in full.

    cache_lengths: [batch] long; tree_mask: [batch, n, m] bool (m >= n) or None -> [batch, 1, n, kv_len] of dtype
    (0 / min).
    """
    device = cache_lengths.device
    batch = cache_lengths.shape[0]
    relative = torch.arange(kv_len, device=device).view(1, 1, kv_len) - cache_lengths.view(batch, 1, 1)  # [b, 1, kv]
    if tree_mask is None:
        query = torch.arange(n, device=device).view(1, n, 1)  # [1, n, 1]
        allowed = relative <= query  # [b, n, kv]: the prefix (relative < 0) and causal among the new tokens
    else:
        below = tree_mask.shape[2] - n  # earlier tree entries the mask covers, right below the fed tokens
        in_block = (relative >= -below) & (relative < n)  # [b, 1, kv]
        index = (relative + below).clamp(0, below + n - 1).expand(batch, n, kv_len)  # [b, n, kv]
        allowed = (relative < -below) | (in_block & tree_mask.gather(2, index))
    mask = torch.zeros(batch, 1, n, kv_len, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)


def ring_mask(mask: torch.Tensor, ends: torch.Tensor, ring: int) -> torch.Tensor:
    """A forward's additive mask over cache indices gathered onto a ring (module docstring): ring index j of row b
    holds the largest cache index below ends[b] congruent to j mod ring, and gets that index's mask value; a ring
    index that holds nothing yet is hidden. While ends <= ring, ring index = cache index (the mask unchanged).

    mask: [batch, 1, n, L] (L: the longest row's end); ends: [batch] long, each row's written length after the
    forward -> [batch, 1, n, min(L, ring)]."""
    batch, _, n, kv_len = mask.shape
    columns = min(kv_len, ring)
    last = ends.view(batch, 1) - 1  # [b, 1]
    held = last - (last - torch.arange(columns, device=mask.device)) % ring  # [b, columns]: the cache index there
    gathered = mask.gather(3, held.clamp(min=0).view(batch, 1, 1, columns).expand(batch, 1, n, columns))
    return gathered.masked_fill_((held < 0).view(batch, 1, 1, columns), torch.finfo(mask.dtype).min)
