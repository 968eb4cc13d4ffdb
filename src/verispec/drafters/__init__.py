"""Drafters: every drafting method is a class behind the `Drafter` interface (base.py)."""

from .base import DraftBatch, DraftProposal, Drafter, DraftRow
from .model import ModelDrafter
from .ngram import NgramDrafter
from .random import RandomDrafter

__all__ = ["DraftBatch", "DraftProposal", "DraftRow", "Drafter", "ModelDrafter", "NgramDrafter", "RandomDrafter"]
