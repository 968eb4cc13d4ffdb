"""Predicted outputs (OpenAI's `prediction`): a request's own guess of its answer, drafted from as it is aligned.

A coding assistant's answer is mostly text the client already has: the file it edits, a few lines changed. The
client sends that text as the request's prediction; `PredictionDrafter` proposes its tokens from where the answer
has got to, in long runs, and the target verifies every one of them as any draft (a point mass, q = one_hot: the
answer is the target's own, token for token, whatever the prediction says).

Alignment (per sequence, on host ints: no device read). `pos` is the prediction index the answer's next token is
expected at. Each committed token that equals prediction[pos] moves it on (accepted draft tokens always do; the
round's bonus or recovered token may); the first one that differs loses it. A lost alignment is found again after
every round from the answer's last tokens: the longest suffix of them (up to `MATCH_TOKENS`) that occurs in the
prediction with a token after it, and of its occurrences the nearest at or after where the alignment was lost
(an edit skips or replaces lines and then goes on), else the nearest before it (text moved up). Until a match is
found the prediction proposes nothing (`can_propose` is False), so a cascade's next stage drafts those rounds.

One drafter per sequence (`with_prediction` makes it, in front of the request's other drafters): its adaptive
policy learns this prediction's acceptance alone, while the costs it measures (draft step, verify widths) are shared
by every prediction's policy (`per_request`, engine/policy.py); its rounds may reach `MAX_DRAFT_TOKENS`, past the
request's max_speculation_depth (`max_depth`): a prediction's tokens cost nothing to draft.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

import torch

from ..config import MAX_DRAFT_TOKENS
from .base import DraftBatch, DraftProposal, Drafter, empty_proposal
from .cascade import CascadeDrafter

MATCH_TOKENS = 8  # longest suffix of the answer looked for in the prediction after a divergence
NAME = "prediction"  # the stage's name in statistics, token origins and metrics


class PredictionDrafter(Drafter):
    """Drafts a request's prediction (token ids of its expected answer), aligned to the answer as it grows."""

    name = NAME
    provides_probs = False
    wants_tokens = True  # the alignment follows each round's committed tokens
    max_depth = MAX_DRAFT_TOKENS
    per_request = True

    def __init__(self, prediction_ids: Sequence[int]) -> None:
        self.ids = [int(t) for t in prediction_ids]
        if not self.ids:
            raise ValueError("the prediction is empty: give its text, or leave prediction out")
        self.tensor = torch.tensor(self.ids, dtype=torch.long)  # [m]: drafts are views of it
        self.where: dict[int, list[int]] = defaultdict(list)  # token -> its prediction indices, ascending
        for index, token in enumerate(self.ids):
            self.where[token].append(index)
        self.begin(0, torch.empty(0, dtype=torch.long))

    # -- alignment -----------------------------------------------------------------------------------------------

    @property
    def aligned(self) -> bool:
        """The prediction has a next token for the answer (what `can_propose` answers)."""
        return self.pos is not None and self.pos < len(self.ids)

    def follow(self, token_ids: list[int]) -> None:
        """The answer's next committed tokens: the alignment moves on, or is lost and looked for again."""
        for token in token_ids:
            self.output.append(token)
            if self.pos is not None and self.pos < len(self.ids) and self.ids[self.pos] == token:
                self.pos += 1
                self.anchor = self.pos
            else:
                self.pos = None
        if self.pos is None:
            self.pos = self.find(self.output[-MATCH_TOKENS:], self.anchor)
            if self.pos is not None:
                self.anchor = self.pos

    def find(self, suffix: list[int], anchor: int) -> int | None:
        """Where the prediction goes on after the longest of `suffix`'s suffixes it contains (with a token after it):
        of that length's occurrences the nearest at or after `anchor`, else the nearest before. None: no match."""
        if not suffix:
            return None
        best, starts = 0, []
        for end in self.where.get(suffix[-1], ()):  # prediction[end] == suffix[-1]
            if end + 1 >= len(self.ids):
                continue  # nothing follows this occurrence
            size = 1
            while size < len(suffix) and size <= end and self.ids[end - size] == suffix[-1 - size]:
                size += 1
            if size > best:
                best, starts = size, [end + 1]
            elif size == best:
                starts.append(end + 1)
        if not starts:
            return None
        after = [start for start in starts if start >= anchor]
        return min(after) if after else max(starts)

    # -- the Drafter interface -----------------------------------------------------------------------------------

    def begin(self, slot: int, prompt_ids: torch.Tensor) -> None:
        self.seen = prompt_ids.numel()  # committed tokens the alignment has followed (prompt + output)
        self.output: list[int] = []  # the answer so far
        self.pos: int | None = 0  # the answer starts where the prediction does
        self.anchor = 0  # where the alignment was last known

    def observe_tokens(self, slot: int, token_ids: list[int]) -> None:
        self.seen += len(token_ids)
        self.follow(token_ids)

    def can_propose(self, token_ids: torch.Tensor) -> bool:
        return self.aligned

    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        start = time.perf_counter()
        proposals = []
        for row in batch.rows:
            pos = self.pos if row.member and row.k > 0 else None
            extra = row.token_ids.numel() - self.seen
            if pos is not None and extra > 0:
                # The context runs past the committed tokens by what a grammar forces next (engine/proposer.py):
                # the prediction goes on after them when it has them too (one host read, structured output only).
                forced = row.token_ids[self.seen :].tolist()
                pos = pos + len(forced) if self.ids[pos : pos + len(forced)] == forced else None
            if pos is None or pos >= len(self.ids):
                proposals.append(empty_proposal(row))
                continue
            proposals.append(DraftProposal(self.tensor[pos : pos + row.k], None))
        seconds = time.perf_counter() - start
        for proposal in proposals:
            proposal.seconds = seconds
        return proposals


def with_prediction(prediction_ids: Sequence[int], drafter: Drafter | None) -> Drafter:
    """A sequence's drafter for a request with a prediction: the prediction first, then `drafter`'s stages (a
    cascade: with adaptive K the stage that pays best drafts each round, drafters/cascade.py); alone without one."""
    own = PredictionDrafter(prediction_ids)
    return own if drafter is None else CascadeDrafter([own, *drafter.stages])
