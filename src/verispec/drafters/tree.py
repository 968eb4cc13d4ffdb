"""Token-tree shapes shared by the drafters that grow trees from their own distribution (head.py, model_tree.py).

Each depth expands the `TREE_BEAM` best nodes of the previous depth into their `TREE_BRANCH` most likely tokens
(EAGLE-2's dynamic tree); a node's score is the log of the product of the draft confidences on its path, an
estimate of the chance that the target accepts it. Of the nodes grown, a tree of point masses keeps the best
(`best_nodes`); `as_tree` renumbers the kept nodes into a `DraftProposal`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .base import DraftProposal, DraftRow

TREE_BRANCH = 4  # children tried per expanded node
TREE_BEAM = 4  # nodes expanded per depth


def best_nodes(scores: list[float], depths: list[int], budget: int,
               verify_cost: Callable[[int], float | None] | None) -> list[int]:
    """Indices of the nodes a tree keeps, ascending (creation order: parents before children): the `budget` best by
    score, fewer where the measured verify costs say so (the count maximising (1 + sum of kept probabilities) /
    verify cost(count + 1)). Scores only fall along a path and ties sort shallower first, so the kept nodes are
    closed under ancestors."""
    order = sorted(range(len(scores)), key=lambda n: (-scores[n], depths[n], n))
    budget = min(budget, len(scores))
    if verify_cost is not None:
        best, best_rate, value = budget, -1.0, 1.0
        for count, n in enumerate(order[:budget], start=1):
            value += math.exp(scores[n])
            cost = verify_cost(count + 1)
            if cost is None:
                break
            rate = value / max(cost, 1e-9)
            if rate > best_rate:
                best, best_rate = count, rate
        budget = best
    return sorted(order[:budget])


def as_tree(row: DraftRow, tokens: list[int], parents: list[int], keep: list[int],
            probs: torch.Tensor | None = None) -> DraftProposal:
    """The nodes `keep` (ascending indices into tokens / parents, closed under ancestors) as a token tree:
    parents[n] is node n's parent as a node number (index + 1; 0 = the root). probs: [len(keep), vocab] or None."""
    number = {n + 1: j + 1 for j, n in enumerate(keep)}  # old node number -> new (the root stays 0)
    device = row.token_ids.device
    return DraftProposal(torch.tensor([tokens[n] for n in keep], dtype=torch.long, device=device), probs,
                         parents=torch.tensor([number.get(parents[n], 0) for n in keep], dtype=torch.long,
                                              device=device))
