"""The proposer: each running row's draft for a round, padded into the verify pass's inputs.

    K per row (policies) -> forced tokens (grammar) -> one propose call per drafter -> grammar cut -> padding

K comes from the policy of whoever drafts the row (`drafter.route`: a cascade's stage has its own estimates); each
policy chooses once per step, knowing the batch size. Every row's draft becomes a node list behind its root (the
last committed token): a chain's node j has parent j - 1, a token tree's parents come from its drafter.

With adaptive K, a row's first round (nothing generated yet, the step it joins) routed to a draft model decodes with
the target alone: its first token comes as soon as with speculation off, and the draft model's prompt prefill waits
for the row's first draft (drafters/model.py), which a row that never drafts never pays. A model-free drafter
(n-gram, suffix) may draft the first round; a fixed K drafts from the first round.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from ..drafters.base import DraftBatch, DraftProposal, DraftRow
from ..sampling import SamplingBatch
from .acceptance import SpecDecodeMetadata, TreeDraft
from . import grammar_rows
from .drafter_calls import DrafterCalls, wants_features
from .policy import AdaptivePolicy, DraftPolicies, FixedK
from .sequence import Sequence


@dataclass
class StepDrafts:
    """A round's drafts, rows in slot order, as the verify pass feeds them: node 0 of a row is its root (the last
    committed token), nodes 1.. its draft tokens; rows with fewer nodes are padded."""

    proposals: list[DraftProposal]  # [batch]: after forced tokens and the grammar cut
    ks: list[int]  # [batch]: draft tokens asked per row (0: the target alone)
    policies: list  # [batch]: each row's draft-length policy (FixedK(0) for the target alone)
    speculative_ks: list[int]  # K of each row with a drafter (0: switched off this round)
    stages: list[str | None]  # [batch]: the drafter (a cascade's stage) routed for each row; None: the target alone
    token_ids: torch.Tensor  # [batch, width] long: root, then draft tokens; 0 at padding
    num_draft_tokens: torch.Tensor  # [batch] long, 0..width - 1
    parents: torch.Tensor | None  # [batch, width] long: parent node (-1 at root and padding); None: all chains
    draft_probs: torch.Tensor | None  # [batch, width, vocab] q of node i at index i, zeros at the root, at padding
    # and in rows without q; None when no row carries q (no allocation)
    has_draft_probs: torch.Tensor  # [batch] bool: the row's q is in draft_probs (else a point mass)
    sampling: SamplingBatch
    wants_features: bool  # a row's drafter reads the target's hidden states

    @property
    def width(self) -> int:
        """Tokens per row of the verify pass (max K + 1)."""
        return self.token_ids.shape[1]

    @property
    def meta(self) -> SpecDecodeMetadata:
        """The draft tokens in node order (a chain row's draft), [batch, width - 1]."""
        return SpecDecodeMetadata(self.token_ids[:, 1:], self.num_draft_tokens)

    @property
    def tree(self) -> TreeDraft | None:
        """The rows as token trees when any row proposed one (a chain row is a one-branch tree); else None."""
        return None if self.parents is None else TreeDraft(self.token_ids, self.parents, self.num_draft_tokens + 1)


class Proposer:
    """Drafts for the running rows of a step."""

    def __init__(self, target, calls: DrafterCalls, policies: DraftPolicies) -> None:
        self.target = target  # the target runner: its device and vocabulary
        self.calls = calls
        self.policies = policies

    def propose(self, rows: list[Sequence]) -> StepDrafts:
        sampling = SamplingBatch.stack([seq.sampling for seq in rows], self.target.vocab_size, self.target.device)
        routed, policies, ks = self._draft_lengths(rows)
        # A speculating row whose grammar forces the next tokens drafts them first; a drafter without probabilities
        # (n-gram) continues after them, from the context extended by them. A model drafter only catches up on them
        # this round: its q would need the grammar state after them. Its cache then holds tokens of the verified
        # sequence only, so `observe` rolls it back as usual.
        forced = [grammar_rows.forced_draft(seq) if k > 0 else None for seq, k in zip(rows, ks)]
        contexts = [seq.committed if f is None else torch.cat([seq.committed, f]) for seq, f in zip(rows, forced)]
        draft_ks = [k if f is None else 0 if stage.provides_probs else max(0, min(k, seq.remaining - 1 - f.numel()))
                    for seq, k, f, stage in zip(rows, ks, forced, routed)]
        proposals = self._draft(rows, contexts, ks, draft_ks, routed, self._tree_budgets(rows, policies), sampling)
        proposals = [grammar_rows.cut(seq, grammar_rows.with_forced(f, p))
                     for seq, f, p in zip(rows, forced, proposals)]
        speculative_ks = [k for seq, k in zip(rows, ks) if seq.drafter is not None]  # a first round left out: K 0
        stages = [None if stage is None else stage.name for stage in routed]
        return self._pad(rows, proposals, ks, policies, speculative_ks, stages, sampling)

    def _draft_lengths(self, rows: list[Sequence]) -> tuple[list, list, list[int]]:
        """-> (routed drafter or None, policy, K) per row. Each policy chooses once per step, knowing the batch size
        and how many of its rows it drafts for."""
        routed, policies = [], []
        for seq in rows:
            active = None
            if seq.drafter is not None:
                route = lambda d: self.policies.route(seq.spec, d, seq.committed, len(rows))  # noqa: E731
                active = self.calls.call(seq.drafter, seq.stats, route, returns=True)
                if active is None:
                    seq.drafter = None
                elif active.prefills_lazily and seq.spec.adaptive and seq.length == seq.prompt_len:
                    active = None  # its first round: the target alone (module docstring)
            routed.append(active)
            policies.append(self.policies.get(seq.spec, active) if active is not None else FixedK(0))
        rows_of = Counter(map(id, policies))  # id(policy) -> rows it drafts for
        chosen = {id(policy): policy.choose(len(rows), rows_of[id(policy)]) for policy in policies}
        ks = [max(0, min(chosen[id(policy)], seq.remaining - 1)) for seq, policy in zip(rows, policies)]
        return routed, policies, ks

    def _draft(self, rows: list[Sequence], contexts: list[torch.Tensor], ks: list[int], draft_ks: list[int],
               routed: list, trees: list[tuple], sampling: SamplingBatch) -> list[DraftProposal]:
        """One propose call per drafter of a speculating row, over every row (its own rows ask their draft_k, the
        others 0: a model drafter catches up on them); a drafter that fails leaves its rows to the target alone."""
        proposals = [DraftProposal(seq.committed.new_empty(0), None) for seq in rows]
        drafting = {id(seq.drafter): seq.drafter for seq, k in zip(rows, ks) if k > 0}
        for drafter in drafting.values():
            members = [seq.drafter is drafter for seq in rows]
            batch = DraftBatch([
                DraftRow(context, k if member else 0, seq.slot, seq.generator, member, seq.spec.speculative_threshold,
                         stage, nodes, cost)
                for seq, context, k, member, stage, (nodes, cost) in zip(rows, contexts, draft_ks, members, routed,
                                                                        trees)
            ], sampling)
            made = self.calls.call(drafter, None, lambda d: d.propose(batch), returns=True,
                                   rows=[seq for seq, member in zip(rows, members) if member])
            if made is not None:
                proposals = [made[i] if member else p for i, (member, p) in enumerate(zip(members, proposals))]
        return proposals

    def _tree_budgets(self, rows: list[Sequence], policies: list) -> list[tuple[int, object]]:
        """[batch]: (tree node budget, verify cost of a width) per row. Trees need position-independent logits
        processing (no penalties or grammar) and exact acceptance; the adaptive policy's measured verify costs let
        the drafter size each tree (rows x width tokens fed: a wide tree costs every row of the step)."""
        if any(not seq.spec.lossless for seq in rows):
            return [(0, None)] * len(rows)
        budgets = []
        for seq, policy in zip(rows, policies):
            nodes = seq.spec.tree_nodes if seq.sampling.allows_trees else 0
            cost = None
            if nodes and isinstance(policy, AdaptivePolicy):
                cost = (lambda width, p=policy, b=len(rows): p.verify_cost(b * width))
            budgets.append((nodes, cost))
        return budgets

    def _pad(self, rows: list[Sequence], proposals: list[DraftProposal], ks: list[int], policies: list,
             speculative_ks: list[int], stages: list[str | None], sampling: SamplingBatch) -> StepDrafts:
        """The verify pass's inputs. No host sync: every size is known on the host, copies stay on the device."""
        device, vocab, batch = self.target.device, self.target.vocab_size, len(rows)
        counts = [p.token_ids.numel() for p in proposals]
        width = 1 + max(counts)
        token_ids = torch.zeros(batch, width, dtype=torch.long, device=device)  # [batch, width]
        token_ids[:, 0] = torch.stack([seq.tokens[seq.length - 1] for seq in rows])
        has_probs = [p.probs is not None and n > 0 for p, n in zip(proposals, counts)]
        draft_probs = None
        if any(has_probs):  # only then: a step without q allocates no [batch, width, vocab]
            draft_probs = torch.zeros(batch, width, vocab, device=device)  # [batch, width, vocab]
        parents = None
        if any(p.is_tree for p in proposals):
            parents = torch.full((batch, width), -1, dtype=torch.long, device=device)  # [batch, width]
        for i, (p, n) in enumerate(zip(proposals, counts)):
            if n == 0:
                continue
            token_ids[i, 1 : n + 1] = p.token_ids.to(device)
            if has_probs[i]:
                draft_probs[i, 1 : n + 1] = p.probs[:, :vocab].to(device)
            if parents is not None:
                parents[i, 1 : n + 1] = p.parents.to(device) if p.is_tree else torch.arange(n, device=device)
        return StepDrafts(proposals, ks, policies, speculative_ks, stages, token_ids, torch.tensor(counts, device=device),
                          parents, draft_probs, torch.tensor(has_probs, device=device), sampling,
                          any(wants_features(seq.drafter) for seq in rows))
