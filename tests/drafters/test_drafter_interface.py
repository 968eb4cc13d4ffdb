"""What the engine asks of a drafter is declared on `Drafter` (drafters/base.py) with defaults, so the engine never
guesses with getattr/hasattr: its stages (one drafter: itself; a cascade: its stages, which the adaptive policy
routes between) and prefix sharing (`keep_prefixes`, passed on by a cascade to every stage)."""

import pytest

from verispec.drafters.base import Drafter
from verispec.drafters.cascade import CascadeDrafter
from verispec.drafters.ngram import NgramDrafter

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


class Keeper(Drafter):
    name = "keeper"

    def __init__(self) -> None:
        self.kept: list[int] = []

    def propose(self, batch):
        return []

    def keep_prefixes(self, tokens: int) -> None:
        self.kept.append(tokens)


def test_a_drafter_is_its_own_only_stage_and_keeps_no_prefixes_by_default():
    ngram = NgramDrafter()
    assert ngram.stages == (ngram,)
    ngram.keep_prefixes(4096)  # the default does nothing, and does not raise


def test_a_cascade_declares_its_stages_and_passes_prefix_sharing_to_each():
    first, second = Keeper(), Keeper()
    cascade = CascadeDrafter([NgramDrafter(), first, second])
    assert [type(s) for s in cascade.stages] == [NgramDrafter, Keeper, Keeper] and cascade.stages[1] is first
    cascade.keep_prefixes(256)
    assert first.kept == [256] and second.kept == [256]
