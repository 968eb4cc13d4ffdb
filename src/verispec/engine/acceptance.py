"""Verification math, as pure vectorised functions.

Names follow Leviathan et al. 2023, Algorithm 1 (and Chen et al. 2023): `p` is the target's distribution,
`q` the drafter's, both after the same sampling transforms (penalties, temperature, top-k/top-p/min-p), so that
the committed tokens follow the processed `p` exactly. Terms (see DEVELOPERS.md): a draft token x is *accepted*
with probability min(1, p(x) / q(x)); at the first *rejected* position a *recovered* token is sampled from the
residual norm(max(0, p - q)); when all k draft tokens are accepted a *bonus* token is sampled from p at
position k. A drafter without probabilities proposes a point mass: q = one_hot(x).

Coupled sampling (`choice_verify`, `choice_tree_verify`) is the other exact mode: the target's token at each
position is a Gumbel-max sample keyed by (seed, position), computed by the caller, and a draft token is accepted iff
it equals it: verification is greedy verification on that choice, and the output is the target alone's for the seed.

Drafts are ragged: row b has num_draft_tokens[b] draft tokens, padded to max_k; padding is never accepted.
All noise is passed in (drawn by the caller from each row's own generator), and nothing here syncs with the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..sampling import sample_from_probs


@dataclass
class SpecDecodeMetadata:
    """The draft tokens of one round for a batch of rows, padded to the longest draft."""

    draft_token_ids: Tensor  # [batch, max_k] long
    """Draft tokens per row; entries at j >= num_draft_tokens[b] are padding (any value)."""
    num_draft_tokens: Tensor  # [batch] long, 0..max_k
    """Draft length per row (ragged)."""

    @property
    def max_k(self) -> int:
        return self.draft_token_ids.shape[1]

    def valid(self) -> Tensor:
        """[batch, max_k] bool: True at real draft tokens, False at padding."""
        positions = torch.arange(self.max_k, device=self.draft_token_ids.device)  # [max_k]
        return positions < self.num_draft_tokens.unsqueeze(-1)


@dataclass
class VerifyResult:
    num_accepted: Tensor  # [batch] long
    """Accepted draft tokens per row, 0..num_draft_tokens[b]."""
    next_token: Tensor  # [batch] long
    """The recovered token, or the bonus token when num_accepted == num_draft_tokens."""


def count_accepted(accepted: Tensor) -> Tensor:
    """Length of the leading run of True per row. accepted: [batch, k] bool -> [batch] long."""
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def greedy_verify(
    meta: SpecDecodeMetadata,
    target_logits: Tensor,  # [batch, max_k + 1, vocab] processed
    extra_accepted: Tensor | None = None,  # [batch, max_k] bool, LOSSY modes only (e.g. top_n_accept)
) -> VerifyResult:
    """Greedy verification: the output equals target-only greedy decoding token for token.

    A draft token is accepted iff it is the target's argmax at its position (and not padding); the next token is
    the target's argmax at position num_accepted (recovered token, or bonus token after a full acceptance).
    """
    return choice_verify(meta, target_logits.argmax(dim=-1), extra_accepted)


def choice_verify(
    meta: SpecDecodeMetadata,
    choices: Tensor,  # [batch, max_k + 1] long: the target's own token at each position
    extra_accepted: Tensor | None = None,  # [batch, max_k] bool, LOSSY modes only (e.g. top_n_accept)
) -> VerifyResult:
    """Verification against the token the target alone would pick at each position: its argmax (greedy), or its
    coupled choice (Gumbel-max with noise keyed by seed and position, `sampling.noise.gumbel_argmax`). A draft
    token is accepted iff it equals the choice at its position; the next token is the choice at num_accepted. The
    committed tokens are then the target alone's, whatever the drafts (coupled: the same tokens for a seed).
    """
    accepted = meta.draft_token_ids == choices[:, : meta.max_k]  # [batch, max_k]
    if extra_accepted is not None:
        accepted = accepted | extra_accepted
    num_accepted = count_accepted(accepted & meta.valid())  # [batch]
    next_token = choices.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [batch]
    return VerifyResult(num_accepted, next_token)


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)) per row; rows where p <= q everywhere (p == q, rejection impossible) fall back to p.

    p, q: [batch, vocab] -> [batch, vocab]
    """
    residual = (p - q).clamp_min_(0)
    mass = residual.sum(dim=-1, keepdim=True)  # [batch, 1]
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def rejection_verify(
    meta: SpecDecodeMetadata,
    draft_probs: Tensor | None,  # [batch, max_k, vocab]; None: every row is a point mass
    has_draft_probs: Tensor | None,  # [batch] bool; None: every row has q when draft_probs is given
    target_probs: Tensor,  # [batch, max_k + 1, vocab]
    uniform_accept: Tensor,  # [batch, max_k], U(0, 1)
    uniform_sample: Tensor,  # [batch], U(0, 1)
    extra_accepted: Tensor | None = None,  # [batch, max_k] bool, LOSSY modes only (e.g. top_n_accept)
) -> VerifyResult:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1) for one round, batched and ragged.

    Draft token x at position j is accepted iff u * q(x) < p(x) (probability min(1, p(x) / q(x)), no division);
    rows without q use q = one_hot(x). At the first rejected position the recovered token is sampled from
    norm(max(0, p - q)); after a full acceptance the bonus token from p. A row with no draft tokens samples p at 0.
    """
    batch, max_k = meta.draft_token_ids.shape
    draft = meta.draft_token_ids.clamp(0, target_probs.shape[-1] - 1)  # [batch, max_k]; padding kept in range
    rows = torch.arange(batch, device=target_probs.device)  # [batch]
    with_q = None  # [batch] bool, or None when no row has q
    if draft_probs is not None:
        with_q = has_draft_probs
        if with_q is None:
            with_q = torch.ones(batch, dtype=torch.bool, device=target_probs.device)
    p_x = target_probs[:, :max_k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [batch, max_k]
    q_x = torch.ones_like(p_x)  # [batch, max_k]: point mass
    if with_q is not None:
        q_x = torch.where(with_q.unsqueeze(-1), draft_probs.gather(-1, draft.unsqueeze(-1)).squeeze(-1), q_x)
    accepted = uniform_accept * q_x < p_x  # [batch, max_k]
    if extra_accepted is not None:
        accepted = accepted | extra_accepted
    num_accepted = count_accepted(accepted & meta.valid())  # [batch]
    p = target_probs[rows, num_accepted]  # [batch, vocab]: p at the rejected or bonus position
    q = torch.zeros_like(p)  # [batch, vocab]: q there; stays zero at the bonus position, so the residual is p
    if max_k > 0:
        at = num_accepted.clamp_max(max_k - 1)  # [batch]
        q.scatter_(-1, draft[rows, at].unsqueeze(-1), 1.0)
        if with_q is not None:
            q = torch.where(with_q.unsqueeze(-1), draft_probs[rows, at].to(p.dtype), q)
        rejected = num_accepted < meta.num_draft_tokens  # [batch]
        q = torch.where(rejected.unsqueeze(-1), q, torch.zeros_like(q))
    next_token = sample_from_probs(residual_distribution(p, q), uniform_sample)  # [batch]
    return VerifyResult(num_accepted, next_token)


def top_n_accept(meta: SpecDecodeMetadata, target_logits: Tensor, n: int | Sequence[int]) -> Tensor:
    """LOSSY: True where a draft token is among the target's n most likely tokens at its position.

    target_logits: [batch, max_k + 1, vocab]; n: one N for all rows, or one per row (0 = off for that row)
    -> [batch, max_k] bool, False at padding.
    """
    per_row = [n] * meta.draft_token_ids.shape[0] if isinstance(n, int) else list(n)
    widest = min(max(per_row, default=0), target_logits.shape[-1])
    if widest == 0 or meta.max_k == 0:
        return torch.zeros_like(meta.draft_token_ids, dtype=torch.bool)
    top = target_logits[:, : meta.max_k].topk(widest, dim=-1).indices  # [batch, max_k, widest]
    limit = torch.tensor(per_row, device=top.device).view(-1, 1, 1)  # [batch, 1, 1]
    within = torch.arange(widest, device=top.device) < limit  # [batch, 1, widest]
    hit = ((top == meta.draft_token_ids.unsqueeze(-1)) & within).any(dim=-1)  # [batch, max_k]
    return hit & meta.valid()


# Token trees (SpecInfer, Miao et al. 2023). A drafter may propose a tree per row instead of a chain, flattened
# into nodes: node 0 is the root (the last committed token, never a draft token), nodes 1.. are draft tokens in
# topological order (parents[b, i] < i; siblings need not be adjacent). The target runs once over all nodes
# (ancestor mask, positions = depths); target_probs[b, i] is p for the token that FOLLOWS node i, so the children
# of node i compete under it. The *accepted path* runs from the root down to the last accepted node; the next
# token is the recovered token there, or the bonus token when that node is a leaf. A chain of k draft tokens is
# the tree parents = [-1, 0, 1, ..., k - 1].
#
# Both verifiers make one increasing pass over node indices with batch-vectorised state (the current node `cur`
# and, when sampling, the residual `r`): a node's parent precedes it, so the children of `cur` all come after it,
# and once `cur` moves into node i the remaining siblings of i no longer have parent == cur and are skipped.


@dataclass
class TreeDraft:
    """Token trees of one round for a batch of rows, flattened and padded to the largest tree."""

    token_ids: Tensor  # [batch, n] long
    """Node 0: the root (last committed token); nodes 1..: draft tokens; padding at i >= num_nodes[b] (any value)."""
    parents: Tensor  # [batch, n] long
    """Parent node index (< own index); -1 at the root and at padding."""
    num_nodes: Tensor  # [batch] long, 1..n
    """Real nodes per row, root included."""

    @property
    def n(self) -> int:
        return self.token_ids.shape[1]

    @classmethod
    def chain(cls, root: Tensor, draft: SpecDecodeMetadata) -> TreeDraft:
        """A chain as a tree: root: [batch] long (the last committed tokens); ragged lengths kept."""
        token_ids = torch.cat([root.unsqueeze(1), draft.draft_token_ids], dim=1)  # [batch, max_k + 1]
        num_nodes = draft.num_draft_tokens + 1  # [batch]
        nodes = torch.arange(draft.max_k + 1, device=root.device)  # [max_k + 1]
        parents = torch.where(nodes < num_nodes.unsqueeze(-1), nodes - 1, -1)  # [batch, max_k + 1]; -1 at root
        return cls(token_ids, parents, num_nodes)

    @classmethod
    def from_lists(
        cls,
        roots: list[int],
        tokens: list[list[int]],
        parents: list[list[int]],
        device: torch.device | str | None = None,
    ) -> TreeDraft:
        """Trees from per-row lists: tokens[b][j] is node j + 1, parents[b][j] its parent node (0 = the root).

        Raises ValueError when the lists disagree in length or a parent is not an earlier node.
        """
        if not len(roots) == len(tokens) == len(parents):
            raise ValueError(f"roots, tokens and parents need one entry per row; got {len(roots)}, {len(tokens)}, "
                             f"{len(parents)}")
        for b, (row_tokens, row_parents) in enumerate(zip(tokens, parents)):
            if len(row_tokens) != len(row_parents):
                raise ValueError(f"row {b}: {len(row_tokens)} tokens but {len(row_parents)} parents")
            for j, parent in enumerate(row_parents):
                if not 0 <= parent <= j:
                    raise ValueError(f"row {b}: node {j + 1} (tokens[{b}][{j}]) has parent {parent}; a parent must "
                                     f"be an earlier node, 0 (the root) to {j}")
        n = 1 + max((len(row) for row in tokens), default=0)
        token_ids = torch.zeros(len(roots), n, dtype=torch.long)
        parent_ids = torch.full((len(roots), n), -1, dtype=torch.long)
        for b, (root, row_tokens, row_parents) in enumerate(zip(roots, tokens, parents)):
            token_ids[b, : len(row_tokens) + 1] = torch.tensor([root, *row_tokens])
            parent_ids[b, 1 : len(row_parents) + 1] = torch.tensor(row_parents, dtype=torch.long)
        num_nodes = torch.tensor([len(row) + 1 for row in tokens], dtype=torch.long)
        return cls(token_ids.to(device), parent_ids.to(device), num_nodes.to(device))

    def valid(self) -> Tensor:
        """[batch, n] bool: True at real nodes (the root included), False at padding."""
        nodes = torch.arange(self.n, device=self.token_ids.device)  # [n]
        return nodes < self.num_nodes.unsqueeze(-1)

    def _parent(self, i: int, valid: Tensor) -> Tensor:
        """[batch] long: parent of node i, 0 at padding (whatever its stored parent) so that it can be gathered."""
        return torch.where(valid[:, i], self.parents[:, i], 0)

    def depths(self) -> Tensor:
        """[batch, n] long: 0 at the root, the parent's depth + 1 below it, 0 at padding (the runner's positions)."""
        valid = self.valid()  # [batch, n]
        depth = torch.zeros_like(self.parents)  # [batch, n]
        for i in range(1, self.n):  # parents precede children: depth[:, parent] is final when node i is reached
            parent_depth = depth.gather(1, self._parent(i, valid).unsqueeze(1)).squeeze(1)  # [batch]
            depth[:, i] = torch.where(valid[:, i], parent_depth + 1, 0)
        return depth

    def ancestor_mask(self) -> Tensor:
        """[batch, n, n] bool: [b, i, j] True iff j == i or j is an ancestor of node i (the tree attention mask).

        Padding nodes see only themselves.
        """
        valid = self.valid()  # [batch, n]
        batch, n = self.parents.shape
        rows = torch.arange(batch, device=self.parents.device)  # [batch]
        mask = torch.eye(n, dtype=torch.bool, device=self.parents.device).repeat(batch, 1, 1)  # [batch, n, n]
        for i in range(1, n):  # the parent's row is complete when node i is reached
            inherited = mask[rows, self._parent(i, valid)] & valid[:, i].unsqueeze(-1)  # [batch, n]
            mask[:, i] |= inherited
        return mask


@dataclass
class TreeVerifyResult:
    path: Tensor  # [batch, max_depth + 1] long
    """Node indices of the accepted path: path[:, 0] = 0 (the root), then one node per accepted draft token, padded
    with 0 after num_accepted. max_depth is the deepest node of any tree in the batch, or the caller's bound."""
    num_accepted: Tensor  # [batch] long
    """Accepted draft tokens per row (path length - 1)."""
    next_token: Tensor  # [batch] long
    """The recovered token, or the bonus token when the last accepted node is a leaf."""


def _extend_path(path: Tensor, num_accepted: Tensor, accepted: Tensor, node: int) -> Tensor:
    """path: [batch, n] with `node` appended where accepted: [batch] bool; num_accepted: [batch], counting it."""
    slots = torch.arange(path.shape[1], device=path.device)  # [n]
    return torch.where(accepted.unsqueeze(-1) & (slots == num_accepted.unsqueeze(-1)), node, path)


def _trim_path(path: Tensor, depth: Tensor, max_depth: int | None) -> Tensor:
    """path: [batch, n] -> [batch, max_depth + 1]; depth: [batch, n] long, the nodes' depths; max_depth: a bound
    the caller knows (no host sync), or None to measure the deepest tree."""
    if max_depth is not None:
        return path[:, : max_depth + 1]
    # One host sync: the result's width is the deepest tree in the batch (n - 1 at most).
    return path[:, : int(depth.max()) + 1] if depth.numel() else path


def greedy_tree_verify(
    tree: TreeDraft,
    target_logits: Tensor,  # [batch, n, vocab] processed; row i scores the token that follows node i
    max_depth: int | None = None,  # a bound on the deepest node (e.g. n - 1): no host sync; None: measured
) -> TreeVerifyResult:
    """Greedy verification of token trees: the output equals target-only greedy decoding token for token.

    From the root, the first child (lowest index) of the current node whose token is the target's argmax there is accepted and
    becomes the current node; when no child matches (or the node is a leaf) the next token is that argmax.
    Padding nodes are never accepted.
    """
    return choice_tree_verify(tree, target_logits.argmax(dim=-1), max_depth)


def choice_tree_verify(
    tree: TreeDraft,
    choices: Tensor,  # [batch, n] long: the target's own token after node i (argmax, or the coupled choice)
    max_depth: int | None = None,  # a bound on the deepest node (e.g. n - 1): no host sync; None: measured
) -> TreeVerifyResult:
    """`greedy_tree_verify` on given choices (see `choice_verify`): a node is accepted iff it is the first child of
    the current node whose token equals the choice there; the next token is the choice after the last accepted."""
    batch, n = tree.token_ids.shape
    valid = tree.valid()  # [batch, n]
    cur = torch.zeros(batch, dtype=torch.long, device=choices.device)  # [batch]: the last accepted node
    num_accepted = torch.zeros_like(cur)  # [batch]
    path = torch.zeros(batch, n, dtype=torch.long, device=choices.device)  # [batch, n]
    depth = torch.zeros(batch, n, dtype=torch.long, device=choices.device)  # [batch, n]
    for i in range(1, n):
        parent = tree._parent(i, valid)  # [batch]
        depth[:, i] = torch.where(valid[:, i], depth.gather(1, parent.unsqueeze(1)).squeeze(1) + 1, 0)
        choice = choices.gather(1, cur.unsqueeze(1)).squeeze(1)  # [batch]: the target's token after cur
        accepted = valid[:, i] & (parent == cur) & (tree.token_ids[:, i] == choice)  # [batch]
        num_accepted = num_accepted + accepted.long()
        path = _extend_path(path, num_accepted, accepted, i)
        cur = torch.where(accepted, i, cur)
    next_token = choices.gather(1, cur.unsqueeze(1)).squeeze(1)  # [batch]
    return TreeVerifyResult(_trim_path(path, depth, max_depth), num_accepted, next_token)


def tree_rejection_verify(
    tree: TreeDraft,
    draft_probs: Tensor | None,  # [batch, n, vocab]: q of each node's token (row 0 unused); None: point masses
    has_draft_probs: Tensor | None,  # [batch] bool; None: every row has q when draft_probs is given
    target_probs: Tensor,  # [batch, n, vocab] processed; row i is p for the token that follows node i
    uniform_accept: Tensor,  # [batch, n], U(0, 1), one per node (index 0 unused)
    uniform_sample: Tensor,  # [batch], U(0, 1)
    max_depth: int | None = None,  # a bound on the deepest node (e.g. n - 1): no host sync; None: measured
) -> TreeVerifyResult:
    """Speculative sampling over token trees: recursive rejection sampling among siblings (SpecInfer, Miao et al.
    2023, multi-step speculative sampling), batched and ragged.

    From the root, with r = p at the current node c: the children of c are visited in index order; child i with
    token x and proposal q_i (draft_probs[b, i], or one_hot(x) for rows without q) is accepted iff
    u_i * q_i(x) < r(x) (probability min(1, r(x) / q_i(x))), and then c = i, r = p at i; a rejected child updates
    r = norm(max(0, r - q_i)) (a point mass just removes x from r). After the pass the next token is sampled from
    r: the recovered token, or the bonus token after a leaf. On a chain this is `rejection_verify`.

    Exact (the committed tokens follow p) when each child's token was drawn from its own q_i, given the prefix
    and its earlier siblings' tokens but independently of the verification noise; q_i is what is passed for node
    i. This covers point masses (deterministic tokens such as a drafter's top-k; a repeated sibling token stays
    exact but is wasted, r(x) = 0 after its first rejection), i.i.d. siblings drawn from one q, and sampling
    without replacement when each child carries the renormalised q it was drawn from.
    """
    batch, n = tree.token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    valid = tree.valid()  # [batch, n]
    tokens = tree.token_ids.clamp(0, vocab - 1)  # [batch, n]; padding kept in range
    with_q = None  # [batch, 1] bool, or None when no row has q
    if draft_probs is not None:
        with_q = torch.ones(batch, 1, dtype=torch.bool, device=device)
        if has_draft_probs is not None:
            with_q = has_draft_probs.view(batch, 1)
    cur = torch.zeros(batch, dtype=torch.long, device=device)  # [batch]: the last accepted node
    r = target_probs[:, 0]  # [batch, vocab]: what the next token must follow, given the rejections so far
    num_accepted = torch.zeros_like(cur)  # [batch]
    path = torch.zeros(batch, n, dtype=torch.long, device=device)  # [batch, n]
    depth = torch.zeros(batch, n, dtype=torch.long, device=device)  # [batch, n]
    for i in range(1, n):
        parent = tree._parent(i, valid)  # [batch]
        depth[:, i] = torch.where(valid[:, i], depth.gather(1, parent.unsqueeze(1)).squeeze(1) + 1, 0)
        x = tokens[:, i].unsqueeze(1)  # [batch, 1]
        q = torch.zeros_like(r).scatter_(1, x, 1.0)  # [batch, vocab]: point mass
        if with_q is not None:
            q = torch.where(with_q, draft_probs[:, i].to(r.dtype), q)
        child = valid[:, i] & (parent == cur)  # [batch]
        accepted = child & (uniform_accept[:, i] * q.gather(1, x).squeeze(1) < r.gather(1, x).squeeze(1))
        rejected = (child & ~accepted).unsqueeze(-1)  # [batch, 1]
        r = torch.where(rejected, residual_distribution(r, q), r)
        r = torch.where(accepted.unsqueeze(-1), target_probs[:, i], r)
        num_accepted = num_accepted + accepted.long()
        path = _extend_path(path, num_accepted, accepted, i)
        cur = torch.where(accepted, i, cur)
    next_token = sample_from_probs(r, uniform_sample)  # [batch]
    return TreeVerifyResult(_trim_path(path, depth, max_depth), num_accepted, next_token)


def path_tokens(tree: TreeDraft, result: TreeVerifyResult) -> SpecDecodeMetadata:
    """The accepted path's draft tokens as a chain, so that chain-only code (logprobs, stats) can read a tree round.

    -> draft_token_ids [batch, max_depth] (0 after num_accepted), num_draft_tokens = num_accepted. The target's
    rows along the path are target_probs[rows, result.path] ([batch, max_depth + 1, vocab]).
    """
    nodes = result.path[:, 1:]  # [batch, max_depth]
    accepted = SpecDecodeMetadata(tree.token_ids.gather(1, nodes), result.num_accepted)
    return SpecDecodeMetadata(torch.where(accepted.valid(), accepted.draft_token_ids, 0), result.num_accepted)
