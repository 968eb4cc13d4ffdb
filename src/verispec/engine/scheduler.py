"""`Scheduler`: which waiting sequences enter the batch at a step, and how much of their prompts is prefilled.

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
  `SpeculativeEngine._join`); a prompt with nothing to prefill (one token) is admitted only when no other is being
  prefilled, as it joins at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .sequence import Sequence


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


class Scheduler:
    """The FIFO queue of waiting sequences and the admitted ones whose prompts are being prefilled."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []  # admitted, prompt not complete; arrival order is their priority

    def __len__(self) -> int:
        """Sequences not yet decoding (waiting or being prefilled)."""
        return len(self.waiting) + len(self.prefilling)

    def schedule(self, decode_tokens: int, free_slots: int) -> list[PrefillChunk]:
        """The prefill chunks of the next step, in order. decode_tokens: what the decoding rows will feed;
        free_slots: slots neither decoding nor held by a sequence being prefilled."""
        budget = self.config.max_batched_tokens
        left = float("inf") if budget is None else budget - decode_tokens
        chunks: list[PrefillChunk] = []
        order = list(self.prefilling)
        staged = len(order)  # sequences holding a slot while being prefilled
        index = 0
        while True:
            if index == len(order):
                if not self.waiting or free_slots < (2 if staged else 1):
                    break
                head = self.waiting[0]
                if staged and head.prompt_len == 1:
                    break  # it joins at once, into the decoding slot: after the others (module docstring)
                if chunks and self._next_chunk(head)[2] > left:
                    break  # strict arrival order: nobody is admitted ahead of the head of the queue
                self.prefilling.append(self.waiting.popleft())
                order.append(head)
                free_slots -= 1
                staged += 1
            seq = order[index]
            index += 1
            while seq in self.prefilling:
                n, joins, cost = self._next_chunk(seq)
                if chunks and cost > left:
                    break  # a later, shorter prompt may still fit
                left -= cost
                chunks.append(PrefillChunk(seq, seq.prefilled, seq.prefilled + n, joins))
                seq.prefilled += n
                if joins:
                    self.prefilling.remove(seq)
                    staged -= 1
        return chunks

    def _next_chunk(self, seq: Sequence) -> tuple[int, bool, int]:
        """-> (tokens, whether the prompt is then complete, budget it takes) of a sequence's next chunk."""
        # The target's cache takes the prompt but its last token, which the first round feeds.
        todo = seq.prompt_len - 1 - seq.prefilled
        size = self.config.prefill_chunk_tokens
        n = todo if size is None else min(size, todo)
        joins = n == todo
        return n, joins, n + joins  # a joining row feeds at least one token in this step's verify pass

    def remove(self, seq: Sequence) -> bool:
        """Take a sequence that has not started decoding out of the queue. -> False if it was not here."""
        for queue in (self.prefilling, self.waiting):
            if seq in queue:
                queue.remove(seq)
                return True
        return False
