"""What every runner shares: `RunnerOutput` (what a forward returns) and `SlotRunner` (slots, lengths, rollback and
compaction as bookkeeping on a `SlotCache`). The Hugging Face runner (hf.py) and the native runner
(native.py) both build on it; select.py picks one (`make_runner`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..caches.kv_cache import SlotCache


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [batch, m, vocab]: at the positions asked for (all n, or logits_at)
    hidden: torch.Tensor | None  # [batch, m, hidden]: the last hidden states there (want_hidden=True; all n fed
    # tokens with all_hidden=True), else None


class SlotRunner:
    """What every runner shares: `num_slots` sequences' KV caches (`self.cache`, a SlotCache) of `max_len` entries;
    rollback, compaction and reset are bookkeeping on the cache's per-slot lengths."""

    cache: SlotCache
    max_len: int
    num_slots: int

    @property
    def lengths(self) -> list[int]:
        """[slot]: entries kept per slot."""
        return self.cache.lengths

    @property
    def length(self) -> int:
        """Entries kept in slot 0 (the one-sequence case)."""
        return self.cache.lengths[0]

    def reserve(self, num_slots: int) -> None:
        """Room for up to num_slots sequences (buffers grow on first use of a slot, so this allocates nothing)."""
        self.cache.reserve(num_slots)
        self.num_slots = self.cache.num_slots

    def truncate(self, length: int, slot: int = 0) -> None:
        """Keep the first `length` entries of `slot` (rollback: never more than the slot holds after a forward)."""
        self.cache.set_length(slot, length)

    @torch.inference_mode()  # the buffers were made under inference mode: in-place writes must be too
    def move_slot(self, src: int, dst: int) -> None:
        self.cache.move(src, dst)

    @torch.inference_mode()
    def keep_path(self, slot: int, base: int, nodes: list[int]) -> None:
        """After a token tree was fed at cache indices base + node: keep the accepted path's entries (nodes, root
        first) at base, base + 1, ...; the slot then holds base + len(nodes) entries. The only copy rollback makes."""
        self.cache.keep_path(slot, base, nodes)

    def reset(self, slot: int | None = None) -> None:
        if slot is None:
            self.cache.reset()
        else:
            self.cache.set_length(slot, 0)

    def _slots(self, start_slot: int, batch: int, n: int) -> tuple[list[int], int]:
        """The kept lengths of slots [start_slot, start_slot + batch) and the longest row after n more tokens."""
        lengths = self.cache.lengths[start_slot : start_slot + batch]
        assert len(lengths) == batch, f"slots [{start_slot}, {start_slot + batch}) exceed {self.num_slots} slots"
        longest = max(lengths) + n
        if longest > self.max_len:
            raise ValueError(f"sequence of {longest} tokens exceeds the KV cache ({self.max_len}); raise max_len")
        return lengths, longest
