"""The verifier: one target pass over every row's draft, and the per-row decision (acceptance.py's math).

A chain is a one-branch tree, and one code path serves both: the target scores each row's root (the last committed
token) and its draft nodes in ONE forward over [batch, width] (a tree with its ancestor mask and positions
length + depth); logits are processed with each row's own sampling parameters; greedy rows keep the target's
argmax path, coupled rows the path of the target's coupled choices (Gumbel-max keyed by seed and output position:
the target alone's tokens for the seed), other sampled rows run rejection sampling with k + 1 uniforms from the
row's own generator (a seeded request draws the same numbers alone or in any batch). Only the math differs, and it is picked at one point
(`_decide`): chain verification where every row is a chain (cheaper: no walk over nodes), tree verification
otherwise; on a chain both give the same result (tests/unit/test_tree_verify.py).

Host syncs: one `.tolist()` per step carries everything the commit branches on (accepted counts, next tokens,
accepted paths, draft tokens, draft depths); `check_finite` reads one flag per forward; logprobs, when a row asks
for them, one more transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..sampling import check_finite, process_logits, row_choices, stable_softmax
from .acceptance import (VerifyResult, choice_tree_verify, choice_verify, path_tokens, rejection_verify,
    top_n_accept, tree_rejection_verify)
from .logprobs import round_logprobs
from .proposer import StepDrafts
from .sequence import Sequence, TokenLogprob


@dataclass
class Verdict:
    """What one verify pass decided, per row (host lists: the commit branches on them)."""

    accepted: list[list[int]]  # [batch][a]: the accepted draft tokens
    path: list[list[int]]  # [batch][a + 1]: the accepted nodes, root (0) first; a chain's are 0..a
    next_token: list[int]  # [batch]: the recovered or bonus token
    depth: list[int]  # [batch]: draft tokens on the row's longest path (a chain's length)
    bonus: list[bool]  # [batch]: the next token is a bonus token (the accepted path ended on a leaf), else recovered
    logprobs: dict[int, list[TokenLogprob]]  # slot -> one per position 0..a, for rows that asked
    verify_s: float
    hidden: torch.Tensor | None  # [batch, width, hidden]: the target's hidden states, when a drafter reads them


class Verifier:
    def __init__(self, target) -> None:
        self.target = target  # the target runner

    def verify(self, rows: list[Sequence], drafts: StepDrafts) -> Verdict:
        start = time.perf_counter()
        tree, meta = drafts.tree, drafts.meta
        depths = None  # [batch, width] node depths of a tree step
        if tree is None:
            out = self.target.forward(drafts.token_ids, want_hidden=drafts.wants_features)
        else:
            lengths = torch.tensor([self.target.lengths[seq.slot] for seq in rows], device=self.target.device)
            depths = tree.depths()  # [batch, width]
            out = self.target.forward(tree.token_ids, positions=lengths.unsqueeze(1) + depths,
                                      tree_mask=tree.ancestor_mask(), want_hidden=drafts.wants_features)
        check_finite(out.logits, "target")  # [batch, width, vocab]
        # A chain row's processing (penalties, grammar) depends on its drafts before each position; a tree row's on a
        # node's depth alone (min_tokens' EOS mask): trees are offered only to rows where that holds.
        processed = process_logits(out.logits, drafts.sampling, meta.draft_token_ids, start=0,
                                   depths=depths)  # [batch, width, vocab]
        result = self._decide(rows, drafts, processed, depths)
        # The one host sync of the step: everything the commit branches on, in one transfer.
        batch = len(rows)
        parts = [result.num_accepted, result.next_token]
        if tree is not None:
            parts += [depths.max(dim=1).values, result.path.flatten(), drafts.parents.flatten()]
        packed = torch.cat([*parts, drafts.token_ids.flatten()]).tolist()
        num_accepted, next_token = packed[:batch], packed[batch : 2 * batch]
        width = drafts.width
        if tree is None:
            depth = [p.token_ids.numel() for p in drafts.proposals]
            paths = [list(range(a + 1)) for a in num_accepted]
            bonus = [a == n for a, n in zip(num_accepted, depth)]  # every draft token accepted
            tokens_at = 2 * batch
        else:
            depth = packed[2 * batch : 3 * batch]
            at = 3 * batch
            paths = [packed[at + i * width : at + i * width + a + 1] for i, a in enumerate(num_accepted)]
            parents_at = at + batch * width
            parents = [packed[parents_at + i * width : parents_at + (i + 1) * width] for i in range(batch)]
            bonus = [path[-1] not in row for path, row in zip(paths, parents)]  # the path ended on a leaf
            tokens_at = parents_at + batch * width
        tokens = [packed[tokens_at + i * width : tokens_at + (i + 1) * width] for i in range(batch)]
        accepted = [[row[node] for node in path[1:]] for row, path in zip(tokens, paths)]
        logprobs = self._logprobs(rows, drafts, processed, result)
        return Verdict(accepted, paths, next_token, depth, bonus, logprobs, time.perf_counter() - start, out.hidden)

    def _decide(self, rows: list[Sequence], drafts: StepDrafts, processed: torch.Tensor, depths: torch.Tensor | None):
        """Per row: accepted count, next token (and a tree's accepted path). processed: [batch, width, vocab];
        depths: [batch, width] a tree step's node depths, None for chains."""
        tree, meta = drafts.tree, drafts.meta
        bound = drafts.width - 1  # the deepest a node can be: paths come back [batch, width], no host sync
        extra = self._lossy_accept(rows, drafts, processed) if tree is None else None
        # Greedy and coupled rows: a draft token is accepted iff it is the target's own choice at its position.
        choices = row_choices(processed, drafts.sampling, depths=depths)  # [batch, width]
        result = choice_verify(meta, choices, extra) if tree is None else choice_tree_verify(tree, choices, bound)
        rejection = [not seq.params.greedy and not c for seq, c in zip(rows, drafts.sampling.coupled)]
        if not any(rejection):
            return result
        # The noise comes from each row's own generator, k + 1 draws per row (a tree row as many as a chain of its
        # k tokens): node j's at [row, j], the recovered or bonus token's apart.
        device = processed.device
        uniform_accept = torch.zeros(len(rows), drafts.width, device=device)  # [batch, width]; root unused
        uniform_sample = torch.zeros(len(rows), device=device)  # [batch]
        for i, seq in enumerate(rows):
            if rejection[i]:
                n = drafts.proposals[i].token_ids.numel()
                u = seq.uniform(n + 1)
                uniform_accept[i, 1 : n + 1] = u[:n]
                uniform_sample[i] = u[n]
        p = stable_softmax(processed)  # [batch, width, vocab]
        q = drafts.draft_probs  # [batch, width, vocab] or None
        if tree is None:
            drawn = rejection_verify(meta, None if q is None else q[:, 1:], drafts.has_draft_probs, p,
                                     uniform_accept[:, 1:], uniform_sample, extra)
        else:
            drawn = tree_rejection_verify(tree, q, drafts.has_draft_probs, p, uniform_accept, uniform_sample, bound)
        chosen = ~torch.tensor(rejection, device=device)  # [batch] bool: greedy and coupled rows keep their choices
        if tree is not None:
            result.path = torch.where(chosen.unsqueeze(1), result.path, drawn.path)
        result.num_accepted = torch.where(chosen, result.num_accepted, drawn.num_accepted)
        result.next_token = torch.where(chosen, result.next_token, drawn.next_token)
        return result

    def _lossy_accept(self, rows: list[Sequence], drafts: StepDrafts, processed: torch.Tensor) -> torch.Tensor | None:
        """[batch, width - 1] bool: LOSSY extra acceptances of rows whose spec asks for them (None when no row does)."""
        tops = [0 if seq.spec.lossless else seq.spec.acceptance_top_k for seq in rows]
        return top_n_accept(drafts.meta, processed, tops) if any(tops) else None

    def _logprobs(self, rows: list[Sequence], drafts: StepDrafts, processed: torch.Tensor,
                  result) -> dict[int, list[TokenLogprob]]:
        """Each committed token's logprob, read along the accepted path (a chain's is its first positions)."""
        if not any(seq.params.logprobs is not None for seq in rows):
            return {}
        if drafts.tree is None:
            return round_logprobs(rows, drafts.meta, processed, result)
        along = result.path.unsqueeze(-1).expand(-1, -1, processed.shape[-1])  # [batch, width, vocab]
        return round_logprobs(rows, path_tokens(drafts.tree, result), processed.gather(1, along),
                              VerifyResult(result.num_accepted, result.next_token))
