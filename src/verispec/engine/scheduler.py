"""`Scheduler`: the waiting, prefilling and running queues, each sequence's status, and slot allocation: which
waiting sequences enter the batch at a step, how much of their prompts is prefilled, and which slot each holds.

Continuous batching: between two steps, waiting sequences take free slots in arrival order (FIFO: a later
request never takes a slot before an earlier one) and their prompts are prefilled into the target's cache, in
chunks of at most `prefill_chunk_tokens` tokens, one forward each. A step feeds the target at most
`max_batched_tokens` tokens: the decoding rows first (each counted at its last round's width, K + 1), then
prefill chunks, the earliest prompt first; a later, shorter prompt may use what the earlier ones cannot (its
prefill completes beside a long one instead of behind it). One chunk always runs when a prompt waits, so a prompt
is never starved, and a long prompt spreads over several steps instead of stalling everyone's decoding.

Invariants:
- a prompt's chunk boundaries depend on the prompt alone (multiples of `prefill_chunk_tokens`), never on the
  load: a request runs the same forwards, so the same numbers, alone or beside others;
- while a prompt is being prefilled, a second one is admitted only if a slot stays free besides, so the engine
  always has a spare slot when a later prompt completes first and must take the decoding slot (see
  `Scheduler.join`); a prompt with nothing to prefill (one token) is admitted only when no other is being
  prefilled, as it joins at once.

Prefix caching (`PrefixCache`, runtime/caches/prefix_cache.py): a sequence admitted finds the longest cached prefix of
its prompt (full blocks of the part the target's cache takes, prompt[:-1]), walking its blocks once; those blocks
are copied into its slot when it is staged, and its prefill starts after them (a fully cached prompt joins at
once). After each prefill chunk the prompt's new full blocks are stored, from the sequence's cursor (its chain of
blocks so far, pinned until it joins or leaves), never re-walked from the root. The head of the queue waits
while a sequence being prefilled will store more of its prefix than is cached now (n copies of one prompt, a
shared system prompt arriving at once): a copy later beats computing the same entries twice. A sequence that found
at least PROTECT_SHARE of its prompt cached (a conversation's next turn: the same file resent, the history) releases
its chain protected, so other prompts are evicted before it (prefix_cache.py, "Conversations").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from ..runtime.caches.prefix_cache import PROTECT_SHARE, PrefixCache
from .sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Admission and prefill limits of one engine (None: unbounded, the whole prompt in one forward)."""

    max_batched_tokens: int | None = None
    """Tokens fed to the target per step: decoding rows (K + 1 each) plus prefill chunks (--max-batched-tokens)."""
    prefill_chunk_tokens: int | None = None
    """Most prompt tokens per prefill forward (--prefill-chunk-tokens); None prefills a prompt in one forward."""

    def __post_init__(self) -> None:
        for name in ("max_batched_tokens", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None for no limit), got {value}")


@dataclass
class PrefillChunk:
    """One prefill forward of a step: prompt tokens [start, end) of `seq`; `joins`: the prompt is then complete
    and the sequence decodes from this step on."""

    seq: Sequence
    start: int
    end: int
    joins: bool


class SlotOwner(Protocol):
    """What owns the slots the scheduler moves when it allocates them: the target runner (its cache:
    runtime/caches/kv_cache.py)."""

    def reset(self, slot: int) -> None: ...

    def move_slot(self, src: int, dst: int) -> None: ...


@dataclass
class PrefixLookup:
    """A sequence's prompt as the prefix cache sees it."""

    tokens: list[int]  # prompt[:-1]: the tokens whose entries the target's cache takes at prefill
    cacheable: bool  # False: the request may not start from cached blocks (its drafter reads the prompt's hidden
    # states); its blocks are stored all the same
    chain: list[int] = field(default_factory=list)  # the prompt's blocks matched, then stored, root first: the
    # cursor of `PrefixCache.extend`, pinned until the sequence joins or leaves
    to_load: int = 0  # matched blocks (chain[:to_load]) still to copy into the slot when it is staged


class Scheduler:
    """The queues of one engine. A sequence is in exactly one: `waiting` (FIFO), admitted (prefilling, holding a
    slot past the decoding rows) or `running` (decoding; index == slot, slots contiguous from 0)."""

    def __init__(self, config: SchedulerConfig | None = None, max_slots: int | None = None,
                 cache: SlotOwner | None = None, prefix: PrefixCache | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.max_slots = max_slots  # None: planning only (schedule()), no slots handed out
        self.cache = cache
        self.prefix = prefix  # None: no prefix caching
        self._lookups: dict[Sequence, PrefixLookup] = {}  # waiting or admitted sequences that may use the prefix cache
        self.waiting: deque[Sequence] = deque()
        self._admitted: list[Sequence] = []  # prefilling until they join; arrival order is their priority
        self.running: list[Sequence] = []  # decoding; index == slot

    @property
    def prefilling(self) -> list[Sequence]:
        """Admitted sequences whose prompts still have chunks to schedule."""
        return [seq for seq in self._admitted if seq.prefilled < seq.prompt_len - 1]

    def __len__(self) -> int:
        """Sequences not yet decoding (waiting or being prefilled)."""
        return len(self.waiting) + len(self.prefilling)

    def enqueue(self, seq: Sequence, prompt: list[int], cacheable: bool = True) -> None:
        """A new request waits for a slot. prompt: its token ids; cacheable: it may start from cached prefix
        blocks (its prompt's blocks are stored either way)."""
        if self.prefix is not None:
            self._lookups[seq] = PrefixLookup(prompt[:-1], cacheable)
        self.waiting.append(seq)

    # -- planning ------------------------------------------------------------------------------------------------

    def admit(self, decode_width: int) -> list[PrefillChunk]:
        """The prefill chunks of the next step (`schedule` with this engine's rows and free slots). decode_width:
        tokens per decoding row of the step (the latest verify pass's width: the best guess of the next)."""
        return self.schedule(decode_tokens=len(self.running) * decode_width,
                             free_slots=self.max_slots - len(self.running) - len(self._admitted))

    def schedule(self, decode_tokens: int, free_slots: int) -> list[PrefillChunk]:
        """The prefill chunks of the next step, in order. decode_tokens: what the decoding rows will feed;
        free_slots: slots neither decoding nor held by a sequence being prefilled."""
        budget = self.config.max_batched_tokens
        left = float("inf") if budget is None else budget - decode_tokens
        chunks: list[PrefillChunk] = []
        order = self.prefilling
        staged = len(order)  # sequences holding a slot while being prefilled
        index = 0
        while True:
            if index == len(order):
                if not self.waiting or free_slots < (2 if staged else 1):
                    break
                head = self.waiting[0]
                if staged and head.prompt_len == 1:
                    break  # it joins at once, into the decoding slot: after the others (module docstring)
                if not self._match_prefix(head):
                    break  # its prefix will be cached soon (module docstring)
                if chunks and self._next_chunk(head)[2] > left:
                    self._unmatch_prefix(head)
                    break  # strict arrival order: nobody is admitted ahead of the head of the queue
                self._admitted.append(self.waiting.popleft())
                head.status = SequenceStatus.PREFILLING
                order.append(head)
                free_slots -= 1
                staged += 1
            seq = order[index]
            index += 1
            while True:
                n, joins, cost = self._next_chunk(seq)
                if chunks and cost > left:
                    break  # a later, shorter prompt may still fit
                left -= cost
                chunks.append(PrefillChunk(seq, seq.prefilled, seq.prefilled + n, joins))
                seq.prefilled += n
                if joins:
                    staged -= 1
                    break
        return chunks

    def _next_chunk(self, seq: Sequence) -> tuple[int, bool, int]:
        """-> (tokens, whether the prompt is then complete, budget it takes) of a sequence's next chunk."""
        # The target's cache takes the prompt but its last token, which the first round feeds.
        todo = seq.prompt_len - 1 - seq.prefilled
        size = self.config.prefill_chunk_tokens
        # Chunks end at multiples of size (after a cached prefix too): boundaries set by the prompt alone.
        n = todo if size is None else min(size - seq.prefilled % size, todo)
        joins = n == todo
        return n, joins, n + joins  # a joining row feeds at least one token in this step's verify pass

    # -- slots ---------------------------------------------------------------------------------------------------

    def stage(self, seq: Sequence) -> None:
        """Give an admitted sequence about to be prefilled a free slot past the decoding rows. The first takes the
        lowest, where it will decode; one prefilled beside it takes the highest, out of the way."""
        held = self._held()
        free = [slot for slot in range(len(self.running), self.max_slots) if slot not in held]
        seq.slot = free[-1] if held else free[0]
        self.cache.reset(seq.slot)
        lookup = self._lookup(seq)
        if lookup is not None and lookup.to_load:
            self.prefix.load(seq.slot, lookup.chain[: lookup.to_load])  # its prefill starts after them (seq.prefilled)
            lookup.to_load = 0

    # -- prefix cache --------------------------------------------------------------------------------------------

    def store_prefix(self, seq: Sequence, end: int) -> None:
        """After a prefill chunk: the new full blocks of prompt[:end], which its slot now holds, go into the prefix
        cache (past the sequence's chain: only those blocks are hashed)."""
        lookup = self._lookup(seq)
        if lookup is not None:
            self.prefix.extend(seq.slot, lookup.tokens[:end], lookup.chain)

    def _lookup(self, seq: Sequence) -> PrefixLookup | None:
        return self._lookups.get(seq) if self.prefix is not None else None

    def _match_prefix(self, seq: Sequence) -> bool:
        """An admitted sequence starts after the longest cached prefix of its prompt (its blocks pinned, copied by
        `stage`). -> False, matching nothing, when a sequence being prefilled will store more of its prefix than
        the cache holds now: it should wait (module docstring)."""
        lookup = self._lookup(seq)
        if lookup is None or not lookup.cacheable:
            return True
        blocks = self.prefix.match(lookup.tokens, count=False)  # the one walk of its blocks for this admission
        others = [self._lookup(other) for other in self._admitted]
        shared = max((self.prefix.common_blocks(lookup.tokens, other.tokens) for other in others if other), default=0)
        if shared > len(blocks):
            return False
        self.prefix.claim(lookup.tokens, blocks)
        self.prefix.pin(blocks)
        lookup.chain, lookup.to_load = blocks, len(blocks)
        seq.prefilled = len(blocks) * self.prefix.block_size
        seq.stats.cached_tokens = seq.prefilled
        return True

    def _unmatch_prefix(self, seq: Sequence) -> None:
        """Undo `_match_prefix` for a sequence that was not admitted after all."""
        lookup = self._lookup(seq)
        if lookup is not None and lookup.cacheable:
            self.prefix.unpin(lookup.chain)
            self.prefix.uncount(len(lookup.tokens), len(lookup.chain))
            lookup.chain, lookup.to_load = [], 0
            seq.prefilled = seq.stats.cached_tokens = 0

    def _release_prefix(self, seq: Sequence) -> None:
        """A sequence that joins or leaves is done with the prefix cache: its chain is unpinned."""
        lookup = self._lookups.pop(seq, None) if self.prefix is not None else None
        if lookup is not None:  # a prompt mostly found cached is a conversation's next turn: its chain protected
            turn = lookup.tokens and seq.stats.cached_tokens >= PROTECT_SHARE * len(lookup.tokens)
            self.prefix.release(lookup.chain, protect=bool(turn))

    def join(self, seq: Sequence) -> None:
        """A sequence whose prompt is complete decodes from now on, in slot len(running) (slots stay contiguous)."""
        slot = len(self.running)
        if seq.slot != slot:
            # One copy of its prompt's entries. A prompt still being prefilled in that slot steps aside first, into
            # the slot kept free (its buffers exist: a second prompt was prefilled at the top).
            held = self._held()
            blocker = next((s for s in self._admitted if s.slot == slot), None)
            if blocker is not None:
                blocker_slot = max(s for s in range(slot, self.max_slots) if s not in held)
                self.cache.move_slot(slot, blocker_slot)
                blocker.slot = blocker_slot
            self.cache.move_slot(seq.slot, slot)
            seq.slot = slot
        self._admitted.remove(seq)
        self._release_prefix(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING

    def retire(self, seq: Sequence) -> tuple[Sequence, int] | None:
        """A running sequence leaves; the last running sequence moves into its slot (one copy of its entries).
        -> (the moved sequence, the slot it left) when one moved, for the caller to move its drafter's slot."""
        slot = seq.slot
        last = self.running.pop()
        moved = None
        if last is not seq:
            self.cache.move_slot(last.slot, slot)
            moved = (last, last.slot)
            last.slot = slot
            self.running[slot] = last
        seq.slot = -1
        seq.status = SequenceStatus.FINISHED
        return moved

    def remove(self, seq: Sequence) -> bool:
        """Take a sequence that has not started decoding out of the queue; a slot it held is free again.
        -> False if it was not here."""
        for queue in (self._admitted, self.waiting):
            if seq in queue:
                queue.remove(seq)
                self._release_prefix(seq)
                if getattr(seq, "slot", -1) >= 0:
                    self.cache.reset(seq.slot)
                    seq.slot = -1
                seq.status = SequenceStatus.FINISHED
                return True
        return False

    def _held(self) -> set[int]:
        """Slots held by admitted sequences (prefilling, or complete and about to join)."""
        return {s.slot for s in self._admitted if s.slot >= 0}
