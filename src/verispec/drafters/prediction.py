"""Predicted outputs (OpenAI's `prediction`): a request's own guess of its answer, drafted from as it is aligned.

A coding assistant's answer is mostly text the client already has: the file it edits, a few lines changed. The
client sends that text as the request's prediction; `PredictionDrafter` proposes its tokens from where the answer
has got to, in long runs, and the target verifies every one of them as any draft (a point mass, q = one_hot: the
answer is the target's own, token for token, whatever the prediction says).

Alignment (per sequence, on host ints: no device read). `pos` is the prediction index the answer's next token is
expected at, `agreement` how many of the answer's last tokens equal the prediction's just before `pos` (how sure
the alignment is). Each committed token that equals prediction[pos] moves it on and confirms it (`anchor`: where
the answer last followed the prediction); the first one that differs loses it. A lost alignment is looked for again
after every round from the answer's last tokens: the longest suffix of them (up to `MATCH_TOKENS`) that occurs in
the prediction with a token after it, and of its occurrences the nearest at or after the anchor (an edit skips or
replaces lines and then goes on); one before the anchor (text moved up) only for a suffix of `BACK_MATCH` tokens or
more, since a short one there is mostly a common token ("\n", an indent) far from the edit. Only confirmed tokens
move the anchor, so a wrong guess never drags the search away from the edit. The answer's opening: the prompt's
tokens in front of the prediction (`lead`: an edit's prompt shows the code after "```python\n", and the answer
opens as the prompt did) match as the prediction's own, so its start is found after them; where the prompt does
not show the prediction, its start is the guess until the answer has followed it.
Until a place is found the prediction proposes nothing (`can_propose` is False): a cascade's next stage drafts.

A round proposes at most `run_cap(agreement)` tokens: a place found from one common token is a guess, and a wide
verify pass costs several plain steps on a CPU, so a guess drafts one or two tokens and each confirmed token
doubles the run, up to the K the policy chose.

One drafter per sequence (`with_prediction` makes it, in front of the request's other drafters): its adaptive
policies are two, which `route` picks by agreement: its guesses' (`PredictionGuesses`, below SURE_TOKENS), learned
anew for each request, so an unrelated prediction's guesses are switched off (K = 0) within a few rounds; and the
confirmed runs' (`RUNS`, one object for every request), learned across requests, so a new request's runs start at
the K earlier edits taught instead of climbing from a short one. The costs they measure (draft step, verify
widths) are shared by every prediction's policies (`per_request`, engine/policy.py); rounds may reach
`MAX_DRAFT_TOKENS`, past the request's max_speculation_depth (`max_depth`): a prediction's tokens cost nothing to
draft.
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
SURE_TOKENS = 3  # agreement from which the alignment drafts as a confirmed run (its own policy), not a guess
LEAD_PROBE = 4  # the prediction's first tokens looked for in the prompt (`lead_in`)
BACK_MATCH = 3  # shortest suffix that may move the alignment back before where the answer last followed it
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
        self.guesses = PredictionGuesses(self)
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
                self.agreement += 1
                self.anchor = self.pos
                self.followed = True
            else:
                self.pos, self.agreement = None, 0
        if self.pos is None:
            self.pos, self.agreement = self.find(self.output[-MATCH_TOKENS:], self.anchor)
            if self.pos is None and not self.lead and not self.followed:
                self.pos = 0  # a preamble the prompt does not show: the prediction's start is the guess

    def find(self, suffix: list[int], anchor: int) -> tuple[int | None, int]:
        """Where the prediction goes on after the longest of `suffix`'s suffixes it contains (with a token after it)
        and that suffix's length: of that length's occurrences the nearest at or after `anchor`, else, for a suffix
        of BACK_MATCH tokens or more, the nearest before. (None, 0): no match. The prompt's tokens in front of the
        prediction (`lead`) count as its own, so an answer that opens as the prompt showed the code finds its start."""
        if not suffix:
            return None, 0
        framed, offset = self.lead + self.ids, len(self.lead)  # the prediction as the prompt frames it
        ends = list(self.where.get(suffix[-1], ()))  # prediction[end] == suffix[-1]
        if self.lead and self.lead[-1] == suffix[-1]:
            ends.insert(0, -1)  # the lead's last token: the prediction goes on at 0
        best, starts = 0, []
        for end in ends:
            if end + 1 >= len(self.ids):
                continue  # nothing follows this occurrence
            size, at = 1, end + offset
            while size < len(suffix) and size <= at and framed[at - size] == suffix[-1 - size]:
                size += 1
            if size < best or (end + 1 < anchor and size < BACK_MATCH):
                continue
            if size > best:
                best, starts = size, [end + 1]
            else:
                starts.append(end + 1)
        if not starts:
            return None, 0
        after = [start for start in starts if start >= anchor]
        return (min(after) if after else max(starts)), best

    # -- the Drafter interface -----------------------------------------------------------------------------------

    def begin(self, slot: int, prompt_ids: torch.Tensor) -> None:
        self.seen = prompt_ids.numel()  # committed tokens the alignment has followed (prompt + output)
        self.lead = lead_in(prompt_ids.tolist(), self.ids)  # once per request: the prompt's ids on the host
        self.output: list[int] = []  # the answer so far
        self.pos: int | None = 0  # the answer starts where the prediction does
        self.agreement = 0  # the answer's last tokens equal to the prediction's just before pos
        self.anchor = 0  # the prediction index after the last token the answer followed
        self.followed = False  # the answer has followed the prediction (a preamble is over)

    def observe_tokens(self, slot: int, token_ids: list[int]) -> None:
        self.seen += len(token_ids)
        self.follow(token_ids)

    def can_propose(self, token_ids: torch.Tensor) -> bool:
        return self.aligned

    def route(self, token_ids: torch.Tensor) -> Drafter:
        """`RUNS` for a confirmed run, `guesses` for a guessed place: each keys its own draft-length policy."""
        return RUNS if self.agreement >= SURE_TOKENS else self.guesses

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
            proposals.append(DraftProposal(self.tensor[pos : pos + min(row.k, run_cap(self.agreement))], None))
        seconds = time.perf_counter() - start
        for proposal in proposals:
            proposal.seconds = seconds
        return proposals


class PredictionGuesses(Drafter):
    """The prediction drafting from a guessed place (agreement below SURE_TOKENS), routed to by its drafter so that
    it has a policy of its own: guesses that do not pay (an unrelated prediction) are switched off (K = 0) while
    confirmed runs keep drafting long. It proposes nothing itself: the engine asks the sequence's drafter."""

    name = NAME
    provides_probs = False
    max_depth = MAX_DRAFT_TOKENS
    per_request = True

    def __init__(self, owner: PredictionDrafter) -> None:
        self.owner = owner

    def can_propose(self, token_ids: torch.Tensor) -> bool:
        return self.owner.can_propose(token_ids)

    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        return self.owner.propose(batch)


def lead_in(prompt_ids: list[int], prediction_ids: list[int]) -> list[int]:
    """The MATCH_TOKENS prompt tokens in front of the prediction's last occurrence in the prompt (its first
    LEAD_PROBE tokens; an edit's prompt shows the code it asks back, e.g. after "```python\n"); [] when absent."""
    probe = prediction_ids[:LEAD_PROBE]
    for start in range(len(prompt_ids) - len(probe), 0, -1):
        if prompt_ids[start : start + len(probe)] == probe:
            return prompt_ids[max(0, start - MATCH_TOKENS) : start]
    return []


class PredictionRuns(Drafter):
    """Every prediction's confirmed runs (agreement of SURE_TOKENS or more), one object that `route` names, so their
    draft-length policy is one per engine, learned across requests: how far an edit's unchanged text goes on is a
    property of edits more than of one request, and a new request should not start its runs at a short K. It
    proposes nothing itself: the engine asks the sequence's drafter."""

    name = NAME
    provides_probs = False
    max_depth = MAX_DRAFT_TOKENS
    per_request = True  # its policy measures into the costs the guesses' policies share

    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        raise AssertionError("a prediction's runs are proposed by the sequence's PredictionDrafter")


RUNS = PredictionRuns()


def run_cap(agreement: int) -> int:
    """The most tokens a round drafts from an alignment the answer's last `agreement` tokens support: 1, 2, 4, ...
    (a guess drafts little; a confirmed run drafts what the policy's K allows)."""
    return 1 << min(agreement, 6)


def with_prediction(prediction_ids: Sequence[int], drafter: Drafter | None) -> Drafter:
    """A sequence's drafter for a request with a prediction: the prediction first, then `drafter`'s stages (a
    cascade: with adaptive K the stage that pays best drafts each round, drafters/cascade.py); alone without one."""
    own = PredictionDrafter(prediction_ids)
    return own if drafter is None else CascadeDrafter([own, *drafter.stages])
