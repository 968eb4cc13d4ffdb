"""The prediction drafter's alignment by hand (drafters/prediction.py): it continues where the answer left the
prediction, is found again after a divergence from the answer's last tokens (longest suffix, nearest at or after
where it was lost, else nearest before), and drafts the prediction's next K tokens from there."""

import pytest
import torch

from conftest import draft_batch
from verispec.drafters.cascade import CascadeDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.prediction import PredictionDrafter, with_prediction


def begun(prediction, prompt_len=3):
    drafter = PredictionDrafter(prediction)
    drafter.begin(0, torch.arange(prompt_len))
    return drafter


def draft(drafter, k, committed):
    """The drafter's proposal for a row of `committed` tokens (prompt + answer) asking k."""
    return drafter.propose(draft_batch([committed], [k], vocab=100))[0].token_ids.tolist()


def test_follows_the_answer_and_drafts_the_next_tokens():
    drafter = begun([10, 11, 12, 13, 14, 15])
    assert drafter.can_propose(torch.arange(3)) and draft(drafter, 4, [0, 1, 2]) == [10, 11, 12, 13]
    drafter.observe_tokens(0, [10, 11])  # two accepted, say, and a bonus equal to the prediction's next
    assert drafter.pos == 2 and draft(drafter, 9, [0, 1, 2, 10, 11]) == [12, 13, 14, 15]  # up to its end
    drafter.observe_tokens(0, [12, 13, 14, 15])
    assert not drafter.can_propose(torch.arange(9)) and draft(drafter, 4, list(range(9))) == []


def test_found_again_after_a_divergence_nearest_after_where_it_was_lost():
    # The answer replaces "30 31" by "99" and goes on with "32 ..."; "7 32" occurs twice: the one after wins.
    prediction = [7, 32, 1, 2, 20, 21, 30, 31, 7, 32, 40, 41, 42]
    drafter = begun(prediction)
    drafter.observe_tokens(0, [7, 32, 1, 2, 20, 21])  # aligned up to index 6
    assert drafter.pos == 6
    drafter.observe_tokens(0, [99])  # the recovered token differs from prediction[6] = 30: lost
    assert drafter.pos is None and not drafter.can_propose(torch.arange(10))
    drafter.observe_tokens(0, [7])  # "99 7": only "7" matches, at indices 0 and 8; after the loss (6): 8
    assert drafter.pos == 9 and draft(drafter, 3, list(range(11))) == [32, 40, 41]


def test_the_longest_suffix_wins_then_the_nearest_before():
    prediction = [5, 6, 7, 1, 9, 9, 7, 2, 3]
    drafter = begun(prediction)
    drafter.observe_tokens(0, [5, 6, 7, 1, 9, 9, 7, 2, 3][:8])  # aligned at index 8
    drafter.observe_tokens(0, [4, 5, 6, 7])  # diverged at 8; "5 6 7" (length 3) matches only before: index 3
    assert drafter.pos == 3 and drafter.anchor == 3
    # No match at all: nothing to propose until one comes.
    drafter.observe_tokens(0, [50, 51])
    assert drafter.pos is None and draft(drafter, 4, list(range(20))) == []


def test_an_occurrence_at_the_very_end_is_no_match():
    drafter = begun([1, 2, 3])
    drafter.observe_tokens(0, [8, 3])  # 3 occurs only last: nothing follows it
    assert drafter.pos is None


def test_grammar_forced_tokens_in_the_context_move_the_draft_on():
    drafter = begun([10, 11, 12, 13, 14])
    assert draft(drafter, 2, [0, 1, 2, 10, 11]) == [12, 13]  # two forced tokens the prediction has too
    assert draft(drafter, 2, [0, 1, 2, 10, 99]) == []  # forced tokens it does not have
    assert drafter.pos == 0  # proposing changes no alignment


def test_rows_of_other_sequences_get_nothing():
    drafter = begun([10, 11])
    batch = draft_batch([[0, 1, 2], [0, 1, 2]], [2, 2], vocab=100)
    batch.rows[1].member = False
    assert [p.token_ids.tolist() for p in drafter.propose(batch)] == [[10, 11], []]


def test_with_prediction_goes_first_and_refuses_an_empty_prediction():
    assert isinstance(with_prediction([1, 2], None), PredictionDrafter)
    ngram = NgramDrafter()
    cascade = with_prediction([1, 2], ngram)
    assert isinstance(cascade, CascadeDrafter) and cascade.stages[1] is ngram
    assert isinstance(cascade.stages[0], PredictionDrafter) and cascade.name == "prediction+ngram"
    with pytest.raises(ValueError, match="prediction is empty"):
        PredictionDrafter([])
