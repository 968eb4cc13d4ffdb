"""Automatic prefix caching: the KV entries of prompt prefixes kept in fixed-size blocks beside a `SlotCache`,
shared read-only by the sequences whose prompts start the same (vLLM's APC, SGLang's RadixAttention).

A block holds the keys/values of `block_size` consecutive tokens at positions [i * block_size, (i + 1) *
block_size) of some prompt, for every layer. It is keyed by (its parent block, its tokens): the parent is the
block of the tokens before it (ROOT for the first), so a key names the whole prefix exactly (a radix tree of
blocks; no hash collision can map two prefixes to one block). A sequence's prefix is found by walking its
prompt's blocks from the root (`match`), copied into its slot before its prefill (`load`, one copy per layer:
far cheaper than recomputing) and, as it is prefilled, its full blocks are copied out of its slot: chunk by chunk
(`extend`, from the sequence's cursor: its chain of blocks so far, so each block is hashed once per sequence),
or all at once (`insert`).

Eviction is LRU among unpinned blocks. A sequence pins its chain (the blocks it matched at admission, then those
it stored) while it is being prefilled, and `release` then touches the whole chain, descendants before
ancestors: every unpinned block's ancestors are more recent than it, so the least recently used unpinned block is
a leaf, and no stored block ever loses its parent. The pins also keep a matched block from being evicted before
it is loaded into the slot, and a chain's blocks from being reused under its cursor.

Conversations (agent loops resend the same file with a new instruction; a chat resends its history): a request
that found at least `PROTECT_SHARE` of its prompt cached is a conversation's next turn, and `release(chain,
protect=True)` keeps its chain protected for `protect_s` seconds (300 by default: a tool's run, a user's reading
and typing), renewed by every turn. Eviction takes the least recently used unprotected, unpinned block first, and
only when none is left the least recently used protected one (protection never refuses a store). A burst of other
prompts therefore evicts the one-off prompts before an active conversation's file; a conversation idle past
`protect_s` is plain LRU again. The first turn is not protected (nothing says yet that it will come back); it is
the most recently used all the same. The leaf rule holds: a chain is protected from its root, and an ancestor's
protection lasts at least as long as any descendant's, so an unprotected (or expired) block has no protected
descendant.

Exactness: the entries copied are the ones a prefill of the same tokens at the same positions wrote; a hit skips
those forwards and changes nothing else (fp32 greedy tokens are identical; the prefill's widths differ, so logits
agree to float rounding until the forward is width-invariant).

A cache whose sliding-window layers keep rings (kv_cache.py: only a layer's latest window + slack entries) gets no
prefix caching (capacity 0, said in the log): a prompt's blocks would have to be copied out of those layers
before later tokens overwrite them, which a prefill in one forward longer than the ring already does.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from .kv_cache import SlotCache

logger = logging.getLogger("verispec")

ROOT = -1  # the parent of a prompt's first block
BLOCK_SIZE = 16  # tokens per block (vLLM's default)
PROTECT_S = 300.0  # seconds a conversation's chain stays protected after its latest turn
PROTECT_SHARE = 0.5  # a request that found this share of its prompt cached is a conversation's next turn


class PrefixCache:
    """Blocks of KV entries for `cache`'s layers, at most `max_tokens // block_size` of them (LRU beyond)."""

    def __init__(self, cache: SlotCache, max_tokens: int, block_size: int = BLOCK_SIZE, protect_s: float = PROTECT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.cache = cache
        self.block_size = block_size
        self.capacity = max(max_tokens, 0) // block_size  # blocks
        if cache.has_rings and self.capacity:
            logger.info("prefix caching off for this model: its sliding-window layers keep only their latest entries "
                        "(a ring), so a prompt's blocks cannot be copied out of them")
            self.capacity = 0
        self.data: torch.Tensor | None = None  # [blocks, layers, 2 (keys, values), kv_heads, block_size, head_dim]
        self.table: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent block, tokens) -> block
        self.keys: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its key
        self.lru: OrderedDict[int, None] = OrderedDict()  # stored blocks, least recently used first
        self.pins: dict[int, int] = {}  # block -> sequences about to load it
        self.allocated = 0  # block ids handed out: [0, allocated)
        self.protect_s = protect_s
        self.clock = clock  # seconds; tests drive their own
        self.protected: dict[int, float] = {}  # block -> until when (clock) it is evicted only after unprotected ones
        self.evicted = 0  # blocks evicted (LRU)
        self.evicted_protected = 0  # of those, protected ones (every unprotected block was pinned)
        self.queried_tokens = 0  # prompt tokens looked up (each admitted prompt's cacheable part)
        self.hit_tokens = 0  # of those, found in the cache

    @property
    def stored(self) -> int:
        """Blocks stored."""
        return len(self.lru)

    @property
    def bytes_per_block(self) -> int:
        """2 x layers x kv_heads x block_size x head_dim x dtype bytes (0 before the first insert)."""
        return 0 if self.data is None else self.data[0].numel() * self.data.element_size()

    # -- lookup --------------------------------------------------------------------------------------------------

    def match(self, tokens: list[int], count: bool = True) -> list[int]:
        """The blocks of the longest cached prefix of `tokens` made of full blocks, root first. count: a real
        lookup, whose blocks become the most recently used and which `queried_tokens` / `hit_tokens` count
        (False: a peek that changes nothing)."""
        blocks: list[int] = []
        parent = ROOT
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            block = self.table.get((parent, tuple(tokens[start : start + self.block_size])))
            if block is None:
                break
            blocks.append(block)
            parent = block
        if count:
            self._touch(blocks)
            self.queried_tokens += len(tokens) // self.block_size * self.block_size
            self.hit_tokens += len(blocks) * self.block_size
        return blocks

    def claim(self, tokens: list[int], blocks: list[int]) -> None:
        """Count a lookup whose blocks a peek (`match(count=False)`) found just before, and touch them: the same as
        `match(tokens)` without walking the blocks again."""
        self._touch(blocks)
        self.queried_tokens += len(tokens) // self.block_size * self.block_size
        self.hit_tokens += len(blocks) * self.block_size

    def uncount(self, tokens: int, blocks: int) -> None:
        """Take back a counted lookup of `tokens` tokens that found `blocks` blocks (its request was not admitted)."""
        self.queried_tokens -= tokens // self.block_size * self.block_size
        self.hit_tokens -= blocks * self.block_size

    def common_blocks(self, a: list[int], b: list[int]) -> int:
        """Full blocks two token lists share from their start."""
        n = 0
        limit = min(len(a), len(b)) // self.block_size * self.block_size
        while n < limit and a[n] == b[n]:
            n += 1
        return n // self.block_size

    def pin(self, blocks: list[int]) -> None:
        for block in blocks:
            self.pins[block] = self.pins.get(block, 0) + 1

    def unpin(self, blocks: list[int]) -> None:
        for block in blocks:
            self.pins[block] -= 1
            if not self.pins[block]:
                del self.pins[block]

    # -- copies --------------------------------------------------------------------------------------------------

    @torch.inference_mode()  # the slot buffers were made under inference mode: in-place writes must be too
    def load(self, slot: int, blocks: list[int]) -> int:
        """Copy `blocks` (a matched prefix, root first) into slot's entries [0, n); the slot then keeps n = blocks x
        block_size entries. -> n."""
        n = len(blocks) * self.block_size
        if not blocks:
            return 0
        index = torch.tensor(blocks, device=self.data.device)
        entries = self.data.index_select(0, index)  # [blocks, layers, 2, kv_heads, block_size, head_dim]
        heads, dim = entries.shape[3], entries.shape[5]
        # [layers, 2, kv_heads, n, head_dim]: the blocks side by side along the token axis
        entries = entries.permute(1, 2, 3, 0, 4, 5).reshape(entries.shape[1], 2, heads, n, dim)
        self.cache.write_prefix(slot, entries)
        return n

    def insert(self, slot: int, tokens: list[int]) -> None:
        """Store the full blocks of `tokens`, whose entries slot holds at [0, len(tokens)), at once."""
        chain: list[int] = []
        self.extend(slot, tokens, chain)
        self.release(chain)

    @torch.inference_mode()
    def extend(self, slot: int, tokens: list[int], chain: list[int]) -> None:
        """Store the full blocks of `tokens` (slot holds their entries at [0, len(tokens))) past `chain`, a
        sequence's cursor: its blocks so far, root first, pinned (module docstring). Only the blocks past the chain
        are looked up; each one found or stored joins the chain, pinned. Blocks stored already are only taken (one
        evicted since is stored again: the slot still holds its entries). Stops early when every block is pinned;
        the next call goes on from there."""
        if self.capacity == 0:
            return
        bs = self.block_size
        parent = chain[-1] if chain else ROOT
        new: list[tuple[int, int]] = []  # (block, its index in the prompt)
        for i in range(len(chain), len(tokens) // bs):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            block = self.table.get(key)
            if block is None:
                block = self._allocate()
                if block is None:
                    break  # every other block is pinned
                self.table[key] = block
                self.keys[block] = key
                new.append((block, i))
            self.pin([block])
            self.lru[block] = None  # stored; its place in the LRU order is set by `release`
            chain.append(block)
            parent = block
        if new:
            self._copy_out(slot, new)

    def clear(self) -> None:
        """Forget every stored block (none may be pinned): the next lookups start cold (`bench --workload
        long-context` times cold prompts so). The counters and the allocated buffer stay."""
        assert not self.pins, "clear() while a sequence holds cached blocks"
        self.table.clear()
        self.keys.clear()
        self.lru.clear()
        self.protected.clear()
        self.allocated = 0

    def release(self, chain: list[int], protect: bool = False) -> None:
        """A sequence is done with its chain (prefilled, or gone): the chain becomes the most recently used, in
        order, and is unpinned; `protect`: a conversation's turn, protected for protect_s (module docstring)."""
        self._touch(chain)
        self.unpin(chain)
        if protect and self.protect_s > 0:
            until = self.clock() + self.protect_s
            for block in chain:  # root first: an ancestor's protection never ends before a descendant's
                self.protected[block] = max(self.protected.get(block, until), until)

    def _copy_out(self, slot: int, new: list[tuple[int, int]]) -> None:
        bs = self.block_size
        first, last = new[0][1], new[-1][1] + 1  # prompt blocks [first, last) cover every new one
        entries = self.cache.read_entries(slot, first * bs, last * bs)  # [layers, 2, kv_heads, tokens, head_dim]
        layers, _, heads, _, dim = entries.shape
        # [prompt blocks, layers, 2, kv_heads, block_size, head_dim]
        entries = entries.reshape(layers, 2, heads, last - first, bs, dim).permute(3, 0, 1, 2, 4, 5)
        self._grow(entries)
        source = torch.tensor([i - first for _, i in new], device=entries.device)
        target = torch.tensor([block for block, _ in new], device=self.data.device)
        self.data.index_copy_(0, target, entries.index_select(0, source).to(self.data.device, self.data.dtype))

    def _grow(self, like: torch.Tensor) -> None:
        """Room for every block handed out (doubling, up to capacity); `like`: [*, layers, 2, heads, bs, dim]."""
        size = 0 if self.data is None else self.data.shape[0]
        if size >= self.allocated:
            return
        grown = min(max(self.allocated, 2 * size, 16), self.capacity)
        data = like.new_empty(grown, *like.shape[1:])
        if self.data is not None:
            data[:size] = self.data
        self.data = data

    def _allocate(self) -> int | None:
        """A block to fill: a new one (up to capacity), else the least recently used unpinned block (a leaf: see
        the module docstring). None when none is left."""
        if self.allocated < self.capacity:
            self.allocated += 1
            return self.allocated - 1
        now, fallback = self.clock(), None
        for block in self.lru:
            if block in self.pins:
                continue
            if self.protected.get(block, now) > now:
                fallback = block if fallback is None else fallback  # the least recently used protected block
                continue
            return self._evict(block)
        return None if fallback is None else self._evict(fallback)

    def _evict(self, block: int) -> int:
        del self.table[self.keys.pop(block)]
        del self.lru[block]
        if self.protected.pop(block, 0.0) > self.clock():
            self.evicted_protected += 1
        self.evicted += 1
        return block

    def _touch(self, chain: list[int]) -> None:
        """Mark a chain (root first) most recently used, descendants before ancestors."""
        for block in reversed(chain):
            self.lru[block] = None
            self.lru.move_to_end(block)
