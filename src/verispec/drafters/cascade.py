"""Several drafters, one of which drafts each row's round.

With adaptive speculation (the default) the engine picks the stage per row and step by tokens per cost
(engine/policy.py, `DraftPolicies.route`): of the stages that can propose, the one whose own policy predicts the
most committed tokens per second, or no draft when none pays. With a fixed K (and for `route` called on its own)
the first stage that can propose drafts, in the order given.

`--draft-model ngram+MODEL` puts prompt lookup in front of a draft model: a round whose last tokens recur earlier
in the prompt or output (summaries, quotes, code, translations, the target's own repetitions) copies what followed
them at no model cost; any other round asks the draft model. Verification is unchanged: each round's proposal is
verified against its own q (a point mass for the n-gram drafter, the draft model's processed probabilities
otherwise), so greedy output equals the target alone and sampling stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import RunnerOptions
from .base import DraftBatch, DraftProposal, Drafter, DraftRow, empty_proposal

SEPARATOR = "+"


class CascadeDrafter(Drafter):
    """Per row, the first stage that can propose drafts the round; every stage sees begin/observe/move/release.

    Stages keep their own state in step with the committed sequence: a stage that did not draft a round (a
    ModelDrafter) catches up from the committed tokens the next time it is asked, so nothing is re-encoded.
    `route` names the stage that will draft, before K is chosen: with adaptive speculation each stage has its own
    acceptance and cost estimates, so a free n-gram stage can draft long runs while a costly draft model that
    does not pay is switched off (K = 0 for its rounds), and the other way round.
    """

    def __init__(self, stages: Sequence[Drafter]) -> None:
        if len(stages) < 2:
            raise ValueError("a cascade needs at least two drafters, e.g. --draft-model ngram+MODEL")
        self._stages = tuple(stages)
        self.name = SEPARATOR.join(stage.name for stage in self.stages)
        self.provides_probs = any(stage.provides_probs for stage in self.stages)
        self.wants_features = any(stage.wants_features for stage in self.stages)
        self.wants_tokens = any(stage.wants_tokens for stage in self.stages)
        self.last_stage: Drafter | None = None  # a stage that drafted in the latest step (stats, tests)
        self.last_stages: list[Drafter | None] = []  # [row]: the stage that drafted each row in the latest step

    @property
    def stages(self) -> tuple[Drafter, ...]:
        return self._stages

    def keep_prefixes(self, tokens: int) -> None:
        for stage in self.stages:
            stage.keep_prefixes(tokens)

    def can_propose(self, token_ids: torch.Tensor) -> bool:
        return any(stage.can_propose(token_ids) for stage in self.stages)

    def route(self, token_ids: torch.Tensor) -> Drafter:
        """The stage that drafts after `token_ids`: the first that can propose (the last one when none can)."""
        return self.stages[self._stage_index(token_ids)].route(token_ids)

    def reserve(self, num_slots: int, runner: RunnerOptions | None = None) -> None:
        for stage in self.stages:
            stage.reserve(num_slots, runner)

    def begin(self, slot: int, prompt_ids: torch.Tensor) -> None:
        for stage in self.stages:
            stage.begin(slot, prompt_ids)

    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        """Each drafting row goes to the stage `route` names; each stage is asked once, for its rows."""
        stage_of = [self._routed_index(row) if row.member and row.k > 0 else -1 for row in batch.rows]
        proposals = [empty_proposal(row) for row in batch.rows]
        self.last_stages = [None] * len(batch.rows)
        for index, stage in enumerate(self.stages):
            ks = [row.k if chosen == index else 0 for row, chosen in zip(batch.rows, stage_of)]
            if not any(ks):
                continue
            for row, proposal in enumerate(stage.propose(batch.with_k(ks))):
                if stage_of[row] == index:
                    proposals[row] = proposal
                    self.last_stages[row] = stage
        self.last_stage = next((stage for stage in self.last_stages if stage is not None), self.last_stage)
        return proposals

    def observe(self, slot: int, committed_length: int, num_accepted: int, num_proposed: int) -> None:
        for stage in self.stages:
            stage.observe(slot, committed_length, num_accepted, num_proposed)

    def observe_tokens(self, slot: int, token_ids: list[int]) -> None:
        for stage in self.stages:
            if stage.wants_tokens:
                stage.observe_tokens(slot, token_ids)

    def set_scope(self, slot: int, scope: str) -> None:
        for stage in self.stages:
            stage.set_scope(slot, scope)

    def observe_features(self, slot: int, features: torch.Tensor) -> None:
        for stage in self.stages:
            if stage.wants_features:
                stage.observe_features(slot, features)

    def move_slot(self, src: int, dst: int) -> None:
        for stage in self.stages:
            stage.move_slot(src, dst)

    def release(self, slot: int) -> None:
        for stage in self.stages:
            stage.release(slot)

    def _routed_index(self, row: DraftRow) -> int:
        """The stage index of a row: from the engine's `route` answer when it passed one (a stage, or what the
        stage's own `route` named: a prediction's guesses)."""
        for index, stage in enumerate(self.stages):
            if stage is row.routed:
                return index
        for index, stage in enumerate(self.stages):
            if row.routed is not None and stage.route(row.token_ids) is row.routed:
                return index
        return self._stage_index(row.token_ids)

    def _stage_index(self, token_ids: torch.Tensor) -> int:
        for index, stage in enumerate(self.stages[:-1]):
            if stage.can_propose(token_ids):
                return index
        return len(self.stages) - 1

    @property
    def runner(self):
        """The KV-cache runner of the stage that has one (the draft model), for memory accounting."""
        for stage in self.stages:
            if hasattr(stage, "runner"):
                return stage.runner
        raise AttributeError("no stage of this cascade has a KV cache")


def split_spec(name: str) -> list[str]:
    """'ngram+path/to/draft' -> ['ngram', 'path/to/draft']; a name without '+' -> [name]."""
    parts = [part.strip() for part in name.split(SEPARATOR)]
    if len(parts) > 1 and not all(parts):
        raise ValueError(f"--draft-model {name!r}: empty drafter in a '+' list; write e.g. ngram+MODEL")
    return parts
