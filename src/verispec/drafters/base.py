"""The drafter interface: propose draft tokens for a batch of sequences, then observe what the target kept.

A drafter serves the engine's slots (one running sequence per slot, rows of a step in slot order). Per slot:
`begin` when a sequence enters it, `observe` after each round, `move_slot` when the engine compacts its slots,
`release` when the sequence leaves. `propose` sees every running row, including rows it does not draft for
(k = 0, or member = False for sequences that use another drafter), so a drafter with a batched KV cache can run
one forward over the contiguous slots and use idle rows to catch up on committed tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import RunnerOptions
from ..sampling import SamplingBatch


@dataclass
class DraftRow:
    """One running sequence as a drafter sees it at the start of a round."""

    token_ids: torch.Tensor  # [n] long: the committed sequence (prompt + generated); read-only
    k: int  # most draft tokens wanted from this drafter this round (0: none)
    slot: int  # the sequence's slot (== its row index in the DraftBatch)
    generator: torch.Generator  # the sequence's randomness: draws from it depend on this row alone
    member: bool = True  # the sequence drafts with this drafter (`begin` was called for its slot)
    threshold: float = 0.0  # stop early once the drafter's top probability falls below this (0: never)
    routed: Drafter | None = None  # what `route` named for this row this round, when the caller already asked
    tree_nodes: int = 0  # most draft tokens of a token tree this row may verify (0 or <= k: a chain only)
    verify_cost: Callable[[int], float | None] | None = None  # seconds of a verify pass of a given width (measured)


@dataclass
class DraftBatch:
    """All running sequences of a step, in slot order (rows[i].slot == i)."""

    rows: list[DraftRow]
    sampling: SamplingBatch  # the rows' logits processing: q must be processed exactly like p

    def with_k(self, ks: list[int]) -> DraftBatch:
        """The same rows asking for other draft lengths (a cascade hands each stage its rows)."""
        rows = [DraftRow(r.token_ids, k, r.slot, r.generator, r.member, r.threshold, r.routed, r.tree_nodes,
                         r.verify_cost) for r, k in zip(self.rows, ks)]
        return DraftBatch(rows, self.sampling)


@dataclass
class DraftProposal:
    """A chain (parents None: token j follows token j - 1) or a token tree of draft tokens."""

    token_ids: torch.Tensor  # [k'] long, 0 <= k' <= k (a tree: its nodes 1..k', in an order parents-first)
    probs: torch.Tensor | None  # [k', vocab] processed q, or None: a point mass at each draft token
    seconds: float = 0.0  # time of the drafter call that made it (shared by the rows of that call)
    parents: torch.Tensor | None = None  # [k'] long: a tree's parent node of each token (0 = the last committed)
    catch_up_s: float = 0.0  # this row's own draft-cache catch-up (its deferred prompt prefill), apart from
    # `seconds`: draft time in the request's stats, but no part of a draft step's cost in the policy's estimates

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    @property
    def depth(self) -> int:
        """Tokens on the longest path (a chain's length)."""
        if self.parents is None:
            return self.token_ids.numel()
        depths = [0]
        for parent in self.parents.tolist():
            depths.append(depths[parent] + 1)
        return max(depths)


def row_uniforms(rows: list[DraftRow], draws: list[bool], device: torch.device | str) -> torch.Tensor:
    """[batch] one U(0, 1) from each row's own generator where draws[i] (0.5 elsewhere, unused): drawn on the
    generators' device (the target's) and moved to the drafter's `device` in one copy, not one per row."""
    uniform = torch.full((len(rows),), 0.5, device=rows[0].generator.device)  # [batch]
    for i, row in enumerate(rows):
        if draws[i]:
            uniform[i : i + 1] = torch.rand(1, generator=row.generator, device=row.generator.device)
    return uniform.to(device)


def empty_proposal(row: DraftRow, seconds: float = 0.0) -> DraftProposal:
    return DraftProposal(row.token_ids.new_empty(0), None, seconds)


class Drafter(ABC):
    """One drafting method. Stateless drafters ignore begin/observe/move_slot/release/reserve."""

    name: str = "drafter"
    provides_probs: bool = False
    wants_features: bool = False  # observe_features gets the target's last hidden states at committed positions
    wants_tokens: bool = False  # observe_tokens gets each round's committed tokens (host ints: no device read)
    prefills_lazily: bool = False  # a row's first draft pays its prompt's prefill (model.py): adaptive K leaves a
    # row's first round to the target alone, so the first token comes as with speculation off
    max_depth: int | None = None  # adaptive K's ceiling for its rounds (None: the request's max_speculation_depth)
    per_request: bool = False  # made for one sequence (a prediction): its adaptive policy learns acceptance anew,
    # with the cost estimates every drafter of its class shares (engine/policy.py)

    def reserve(self, num_slots: int, runner: RunnerOptions | None = None) -> None:
        """The engine runs up to num_slots sequences at once (called before any `begin`); a drafter with a model
        runs it with the engine's runner options."""

    def begin(self, slot: int, prompt_ids: torch.Tensor) -> None:
        """A new sequence starts in `slot` (prompt_ids: [n]). Drop any state the slot had.

        Also how a drafter recovers after it raised: the engine stops using it for that request and calls
        `begin` before it drafts again, so state left half-updated by the failure must not survive `begin`."""

    @abstractmethod
    def propose(self, batch: DraftBatch) -> list[DraftProposal]:
        """Up to rows[i].k tokens continuing rows[i].token_ids, one proposal per row (empty where k == 0)."""

    def observe(self, slot: int, committed_length: int, num_accepted: int, num_proposed: int) -> None:
        """After verification: the sequence in `slot` now has `committed_length` committed tokens."""

    def observe_tokens(self, slot: int, token_ids: list[int]) -> None:
        """(wants_tokens only) The tokens the round committed to the sequence in `slot`, in order (after `observe`)."""

    def set_scope(self, slot: int, scope: str) -> None:
        """The sequence about to `begin` in `slot` belongs to `scope` (the server: a hash of its API key). A drafter
        that learns from earlier requests (suffix.py) drafts from, and adds to, that scope's requests only."""

    def observe_features(self, slot: int, features: torch.Tensor) -> None:
        """(wants_features only) The target's last hidden states [m, hidden] at the sequence's next m committed
        positions, in order: after the prompt's prefill (positions 0 .. P-2) and after each verify pass."""

    def move_slot(self, src: int, dst: int) -> None:
        """The sequence in slot src now lives in slot dst (dst's sequence has left)."""

    def release(self, slot: int) -> None:
        """The sequence in `slot` has finished or was cancelled."""

    def can_propose(self, token_ids: torch.Tensor) -> bool:
        """Whether `propose` would draft anything after `token_ids` [n] (cheap; default: always)."""
        return True

    @property
    def stages(self) -> tuple[Drafter, ...]:
        """The drafters that take turns drafting (a cascade's stages, in order; one drafter: itself). The engine
        keeps a draft-length policy per stage and, under adaptive K, routes each row to the stage that pays best."""
        return (self,)

    def keep_prefixes(self, tokens: int) -> None:
        """The engine caches prompt prefixes, up to `tokens` tokens (0: off): a drafter with its own KV cache
        (model.py) keeps its own prefixes as many, so a prompt the target found cached costs the draft no prefill
        either. Default: nothing to keep."""

    def route(self, token_ids: torch.Tensor) -> Drafter:
        """The drafter that will propose after `token_ids` [n]: itself, or a composite's member. The engine keys
        its draft-length policy on it, so a cascade's stages each get their own K (see cascade.py)."""
        return self
