"""Token trees from a draft model (model.py's ModelDrafter): one draft forward per depth over every row's frontier,
with tree attention into the draft's own KV cache.

Shape (tree.py): each depth expands up to TREE_BEAM nodes of the previous depth, the best by score (the log of the
product of draft confidences on the path). One forward feeds them all, rows padded to the widest; a node sees the
committed prefix and its own ancestors, which earlier depths wrote right below it (`attention_mask`'s tree_mask
over those entries), never their siblings. An expanded node's children come from the draft's processed
distribution q there:

- greedy and coupled rows: point masses, its TREE_BRANCH most likely tokens (a coupled row's coupled choice
  argmax(log q + g) first, as the target's own choice uses that noise); every grown node is a candidate and the row
  keeps its `tree_nodes` best (`best_nodes`, sized by the measured verify costs). Exact whatever the tree: a node
  is accepted iff it equals the target's own choice after its parent.
- rejection-sampled rows: siblings drawn WITHOUT replacement from q, each child carrying the renormalised q it was
  drawn from (q with its earlier siblings' tokens removed), verified by recursive rejection over siblings
  (acceptance.tree_rejection_verify, SpecInfer / SpecTr multi-draft). That is exact when each child's token
  follows the q it carries given everything drawn before it, independently of the verification noise. So no
  drawn node is pruned afterwards, and how many children a node gets is fixed before they are drawn, from what is
  known then (`_slots`: the q of the nodes expanded at that depth, the scores of the nodes drawn so far, the
  budget left): each depth gets an even share of the budget left over the depths left, given to the (node, rank)
  pairs with the highest estimated score (path score + log of q's rank-th largest probability), and with measured
  verify costs only while a pair raises the estimated tokens per verify cost; a node's ranks are taken in order.
  Such a row draws one uniform from its own generator per node, in depth, node, rank order (at most its
  `tree_nodes` per round, before the verifier's nodes + 1).
- chain rows of the same step (no tree offered): one child per depth, as the chain loop drafts them (sampled rows
  draw from q and carry it, one uniform per depth), with the draft-confidence cut-off.

The caller sets each slot back to its pre-tree length afterwards (the committed prefix): the next round feeds
the accepted tokens as catch-up, so no entry is copied.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..sampling import check_finite, process_logits, row_choices, sample_from_probs, stable_softmax
from .base import DraftBatch, DraftProposal, DraftRow
from .tree import TREE_BEAM, TREE_BRANCH, as_tree, best_nodes

# forward(tokens [b, w], positions [b, w], tree_mask [b, w, m]) -> the draft's logits [b, w, vocab]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grow_trees(forward: Forward, batch: DraftBatch, ks: list[int], kept: list[int], trees: list[bool],
               root_logits: torch.Tensor, to_home: Callable[[torch.Tensor], torch.Tensor]) -> list[DraftProposal]:
    """Trees (rows with trees[i]) and chains of up to ks[i] draft tokens after each row's root (its last committed
    token, at cache index kept[i] - 1). root_logits: [b, 1, vocab] the draft's logits after the root; to_home moves
    a row's q to the target's device."""
    rows, sampling = batch.rows, batch.sampling
    b, device = len(rows), root_logits.device
    sampled = [not greedy and not coupled for greedy, coupled in zip(sampling.greedy.tolist(), sampling.coupled)]
    # Per row: nodes as (token, parent node number (0 = the root), log score, depth, q it was drawn from or None).
    nodes: list[list[tuple]] = [[] for _ in range(b)]
    frontier = [[0] if k > 0 else [] for k in ks]  # per row: the nodes whose children this depth drafts
    paths: list[dict[int, list[int]]] = [{0: []} for _ in range(b)]  # node -> the draft tokens on its path
    seen: list[dict[int, list[int]]] = [{0: []} for _ in range(b)]  # node -> its fed ancestors' and own entries
    left = [row.tree_nodes if tree else k for row, tree, k in zip(rows, trees, ks)]  # nodes a sampled row may draw
    stopped = [False] * b
    widest = TREE_BRANCH if any(trees) else 1
    logits, region = root_logits, 0  # region: entries written past kept[i] by earlier depths (every row alike)
    for depth in range(1, max(ks) + 1):
        check_finite(logits, "draft")
        width = logits.shape[1]
        at_depth = torch.zeros(b, width, dtype=torch.long, device=device)  # every frontier node is at this depth
        # A chain row's processing may read its drafts so far (penalties, grammar); a tree row's never does.
        pending = torch.tensor([paths[i][frontier[i][0]] if frontier[i] else [0] * (depth - 1) for i in range(b)],
                               dtype=torch.long, device=device).view(b, depth - 1)  # [b, depth - 1]
        processed = process_logits(logits, sampling, pending, start=depth - 1, depths=at_depth)  # [b, width, vocab]
        q = stable_softmax(processed)  # [b, width, vocab]
        top_p, top_ids = q.topk(widest, dim=-1)  # [b, width, widest]
        choice_first = int(any(sampling.coupled))  # the rows' own choices lead the top tokens (a coupled row's)
        if choice_first:
            choice = row_choices(processed, sampling, start=depth - 1, depths=at_depth)  # [b, width]
            top_ids = torch.cat([choice.unsqueeze(-1), top_ids], dim=-1)  # [b, width, 1 + widest]
            top_p = torch.cat([q.gather(-1, choice.unsqueeze(-1)), top_p], dim=-1)
        top_p, top_ids = top_p.tolist(), top_ids.tolist()  # one host sync each per depth
        ranks = [[0] * width for _ in range(b)]  # sampled rows: children to draw per frontier node
        children: list[list[int]] = [[] for _ in range(b)]  # node numbers made at this depth
        for i, row in enumerate(rows):
            if depth > ks[i] or stopped[i] or not frontier[i]:
                continue
            if not trees[i] and row.threshold > 0 and depth > 1 and max(top_p[i][0]) < row.threshold:
                stopped[i] = True  # the draft is unsure: verifying what we have is cheaper than guessing on
                continue
            if sampled[i]:
                scores = [nodes[i][n - 1][2] if n else 0.0 for n in frontier[i]]
                top = [p[choice_first:] for p in top_p[i]]  # q's sorted top probabilities per frontier node
                branch = TREE_BRANCH if trees[i] else 1
                ranks[i][: len(scores)] = _slots(top, scores, left[i], ks[i] - depth + 1, branch, nodes[i],
                                                 row.verify_cost if trees[i] else None)
                left[i] -= sum(ranks[i])
                continue
            for f, parent in enumerate(frontier[i]):
                options = list(zip(top_ids[i][f], top_p[i][f]))
                if choice_first:  # the row's choice (a coupled row's coupled choice, else the argmax), then the others
                    options = options[:1] + [o for o in options[1:] if o[0] != options[0][0]]
                for token, prob in options[: TREE_BRANCH if trees[i] else 1]:
                    if prob > 0.0:
                        children[i].append(_add(nodes[i], paths[i], token, parent, math.log(prob), depth, None))
        if any(map(any, ranks)):
            tokens, carried, q_x = _draw(q, _uniforms(rows, ranks, device))
            for i in range(b):
                for f, count in enumerate(ranks[i]):
                    for j in range(count):
                        children[i].append(_add(nodes[i], paths[i], tokens[i][f][j], frontier[i][f],
                                                math.log(q_x[i][f][j]), depth, carried[j][i, f]))
        if depth == max(ks):
            break
        # Expand the best TREE_BEAM children of this depth (a chain's one) in one forward; a sampled row whose
        # budget is spent expands nothing.
        frontier = [sorted(children[i], key=lambda n, i=i: (-nodes[i][n - 1][2], n))[: TREE_BEAM if trees[i] else 1]
                    if depth < ks[i] and not stopped[i] and (left[i] > 0 or not sampled[i]) else [] for i in range(b)]
        if not any(frontier):
            break
        width = max(len(f) for f in frontier)
        tokens = torch.zeros(b, width, dtype=torch.long)  # [b, width], built on the host
        positions = torch.zeros(b, width, dtype=torch.long)  # [b, width]
        tree_mask = torch.zeros(b, width, region + width, dtype=torch.bool)  # [b, width, region + width]
        for i in range(b):
            for t in range(width):
                if t < len(frontier[i]):
                    n = frontier[i][t]
                    token, parent, _, d, _ = nodes[i][n - 1]
                    tokens[i, t], positions[i, t] = token, kept[i] - 1 + d
                    seen[i][n] = seen[i][parent] + [region + t]
                    tree_mask[i, t, seen[i][n]] = True
                else:  # padding: sees the prefix and itself
                    positions[i, t] = kept[i] + region + t
                    tree_mask[i, t, region + t] = True
        logits = forward(tokens, positions, tree_mask)  # [b, width, vocab]
        region += width
    return [_proposal(rows[i], nodes[i], trees[i], sampled[i], to_home) for i in range(b)]


def _add(nodes: list[tuple], paths: dict[int, list[int]], token: int, parent: int, log_prob: float, depth: int,
         q: torch.Tensor | None) -> int:
    """Append a node below `parent` -> its node number."""
    score = (nodes[parent - 1][2] if parent else 0.0) + log_prob
    nodes.append((token, parent, score, depth, q))
    paths[len(nodes)] = paths[parent] + [token]
    return len(nodes)


def _slots(top_p: list[list[float]], scores: list[float], left: int, depths_left: int, branch: int,
           drawn: list[tuple], verify_cost: Callable[[int], float | None] | None) -> list[int]:
    """Children to draw below each frontier node of a sampled row (decided before any is drawn): the best
    min(left, ceil(left / depths_left)) (node, rank) pairs by estimated score, path score + log of q's rank-th
    largest probability; with measured verify costs, only while each pair raises the estimated rate (1 + sum of the
    row's node scores, `drawn` ones and these) / verify cost(nodes + 1), as `best_nodes` sizes a tree of point
    masses. A node's ranks are taken in order (its probabilities are sorted), so rank j is drawn after ranks < j."""
    share = min(left, -(-left // depths_left))
    pairs = sorted((-(score + math.log(p)), f, j) for f, score in enumerate(scores)
                   for j, p in enumerate(top_p[f][:branch]) if p > 0.0)
    counts = [0] * len(scores)
    value, nodes = 1.0 + sum(math.exp(node[2]) for node in drawn), len(drawn)
    for neg_score, f, _ in pairs[:share]:
        gain = math.exp(-neg_score)
        now, more = (verify_cost(nodes + 1), verify_cost(nodes + 2)) if verify_cost is not None else (None, None)
        if now is not None and more is not None and (value + gain) / max(more, 1e-9) <= value / max(now, 1e-9):
            break
        value, nodes = value + gain, nodes + 1
        counts[f] += 1
    return counts


def _uniforms(rows: list[DraftRow], ranks: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """[b, width, max rank]: one U(0, 1) per child to draw, from its row's own generator in node, rank order (0.5
    elsewhere, unused); drawn on the generators' device (the target's), moved in one copy."""
    width, most = len(ranks[0]), max(max(r) for r in ranks)
    uniform = torch.full((len(rows), width, most), 0.5, device=rows[0].generator.device)
    for i, row in enumerate(rows):
        for f, count in enumerate(ranks[i]):
            if count:
                uniform[i, f, :count] = torch.rand(count, generator=row.generator, device=row.generator.device)
    return uniform.to(device)


def without_replacement(q: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Siblings drawn without replacement. q: [b, w, vocab]; uniform: [b, w, R] -> tokens [b, w, R] and, per rank
    j, the distribution the j-th sibling was drawn from ([b, w, vocab]: q with the earlier siblings' tokens removed,
    renormalised; rank 0's is q)."""
    tokens, carried, rest = [], [], q
    for j in range(uniform.shape[-1]):
        x = sample_from_probs(rest.flatten(0, 1), uniform[..., j].flatten()).view(q.shape[:2])  # [b, w]
        tokens.append(x)
        carried.append(rest)
        rest = rest.scatter(-1, x.unsqueeze(-1), 0.0)
        rest = rest / rest.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(rest.dtype).tiny)
    return torch.stack(tokens, dim=-1), carried


def _draw(q: torch.Tensor, uniform: torch.Tensor) -> tuple[list, list[torch.Tensor], list]:
    """The sampled rows' children at one depth -> (tokens [b][w][R] host ints, the q each rank was drawn from,
    q(token) [b][w][R] under the node's own q, for its score); one host sync."""
    tokens, carried = without_replacement(q, uniform)  # [b, w, R]
    q_x = q.gather(-1, tokens)  # [b, w, R]
    packed = torch.stack([tokens.to(q_x.dtype), q_x]).tolist()  # token ids < 2^24: exact in fp32
    return [[[int(t) for t in node] for node in row] for row in packed[0]], carried, packed[1]


def _proposal(row: DraftRow, nodes: list[tuple], tree: bool, sampled: bool,
              to_home: Callable[[torch.Tensor], torch.Tensor]) -> DraftProposal:
    if not nodes:
        return DraftProposal(row.token_ids.new_empty(0), None)
    tokens, parents = [n[0] for n in nodes], [n[1] for n in nodes]
    probs = to_home(torch.stack([n[4] for n in nodes])) if sampled else None  # [nodes, vocab]: each drawn from its q
    if not tree:  # a chain: nodes in depth order, each the child of the previous
        return DraftProposal(torch.tensor(tokens, dtype=torch.long, device=row.token_ids.device), probs)
    if sampled:  # every drawn node stays (pruning by a drawn token's own value would bias it)
        return as_tree(row, tokens, parents, list(range(len(nodes))), probs)
    return as_tree(row, tokens, parents, best_nodes([n[2] for n in nodes], [n[3] for n in nodes], row.tree_nodes,
                                                    row.verify_cost))
