"""The drafter interface: propose up to k tokens, then observe what the target kept."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..sampling import TokenSampler


@dataclass
class DraftRequest:
    """What a drafter sees at the start of a round."""

    token_ids: torch.Tensor  # [n] long: the committed sequence (prompt + generated); read-only
    k: int  # most draft tokens wanted this round (>= 1)
    sampler: TokenSampler  # the sequence's processing: q must be processed exactly like p
    threshold: float = 0.0  # stop early once the drafter's top probability falls below this (0: never)


@dataclass
class DraftProposal:
    token_ids: torch.Tensor  # [k'] long, 0 <= k' <= k
    probs: torch.Tensor | None  # [k', vocab] processed q, or None: a point mass at each draft token
    seconds: float = 0.0


class Drafter(ABC):
    """One drafting method. Stateless drafters ignore `begin`/`observe`."""

    name: str = "drafter"
    provides_probs: bool = False

    def begin(self, prompt_ids: torch.Tensor) -> None:
        """A new sequence starts (prompt_ids: [n]). Drop any state of the previous one.

        Also how a drafter recovers after it raised: the engine stops using it for that request and calls
        `begin` before it drafts again, so state left half-updated by the failure must not survive `begin`."""

    @abstractmethod
    def propose(self, request: DraftRequest) -> DraftProposal:
        """Propose up to request.k tokens continuing request.token_ids."""

    def observe(self, committed_length: int, num_accepted: int, num_proposed: int) -> None:
        """After verification: the committed sequence now has `committed_length` tokens."""

    def can_propose(self, token_ids: torch.Tensor) -> bool:
        """Whether `propose` would draft anything after `token_ids` [n] (cheap; default: always)."""
        return True

    def route(self, token_ids: torch.Tensor) -> "Drafter":
        """The drafter that will propose after `token_ids` [n]: itself, or a composite's member. The engine keys
        its draft-length policy on it, so a cascade's stages each get their own K (see cascade.py)."""
        return self
