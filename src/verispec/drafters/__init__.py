"""Drafters: every drafting method is a class behind the `Drafter` interface (base.py)."""

from .base import DraftProposal, Drafter, DraftRequest
from .model import ModelDrafter
from .ngram import NgramDrafter
from .random import RandomDrafter

__all__ = ["DraftProposal", "Drafter", "DraftRequest", "ModelDrafter", "NgramDrafter", "RandomDrafter"]
