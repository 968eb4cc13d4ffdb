"""The prediction drafter's alignment by hand (drafters/prediction.py): it continues where the answer left the
prediction, is found again after a divergence from the answer's last tokens (longest suffix, nearest at or after
where the answer last followed it; back before that only for BACK_MATCH tokens or more), finds the prediction's start
after the answer's preamble from the prompt's lead, and drafts the prediction's next tokens from there, doubling
the run with each confirmed token."""

import pytest
import torch

from conftest import draft_batch
from verispec.drafters.cascade import CascadeDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.config import MAX_DRAFT_TOKENS
from verispec.drafters.prediction import (BACK_MATCH, RUNS, SURE_TOKENS, PredictionDrafter, lead_in, run_cap,
                                          with_prediction)

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


def begun(prediction, prompt=(0, 1, 2)):
    drafter = PredictionDrafter(prediction)
    drafter.begin(0, torch.tensor(prompt))
    return drafter


def draft(drafter, k, committed):
    """The drafter's proposal for a row of `committed` tokens (prompt + answer) asking k."""
    return drafter.propose(draft_batch([committed], [k], vocab=100))[0].token_ids.tolist()


def test_follows_the_answer_and_drafts_longer_runs_as_it_is_confirmed():
    drafter = begun([10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    assert drafter.can_propose(torch.arange(3)) and draft(drafter, 4, [0, 1, 2]) == [10]  # a guess: one token
    drafter.observe_tokens(0, [10, 11])  # accepted, and a bonus equal to the prediction's next
    assert (drafter.pos, drafter.agreement) == (2, 2) and draft(drafter, 9, [0, 1, 2, 10, 11]) == [12, 13, 14, 15]
    drafter.observe_tokens(0, [12, 13, 14])
    assert run_cap(drafter.agreement) == 32 and draft(drafter, 9, list(range(8))) == [15, 16, 17, 18, 19]  # to its end
    assert draft(drafter, 2, list(range(8))) == [15, 16]  # never past the policy's K
    drafter.observe_tokens(0, [15, 16, 17, 18, 19])
    assert not drafter.can_propose(torch.arange(13)) and draft(drafter, 4, list(range(13))) == []


def test_run_cap_doubles_with_each_confirmed_token_up_to_the_most_a_round_drafts():
    assert [run_cap(a) for a in range(8)] == [1, 2, 4, 8, 16, 32, 64, 64]
    assert run_cap(100) == MAX_DRAFT_TOKENS


def test_found_again_after_a_divergence_nearest_after_where_it_was_lost():
    # The answer replaces "30 31" by "99" and goes on with "32 ..."; "7 32" occurs twice: the one after wins.
    prediction = [7, 32, 1, 2, 20, 21, 30, 31, 7, 32, 40, 41, 42]
    drafter = begun(prediction)
    drafter.observe_tokens(0, [7, 32, 1, 2, 20, 21])  # aligned up to index 6
    assert drafter.pos == 6 and drafter.anchor == 6
    drafter.observe_tokens(0, [99])  # the recovered token differs from prediction[6] = 30: lost
    assert drafter.pos is None and not drafter.can_propose(torch.arange(10))
    drafter.observe_tokens(0, [7])  # "99 7": only "7" matches, at indices 0 and 8; at or after the anchor (6): 8
    assert (drafter.pos, drafter.agreement) == (9, 1) and draft(drafter, 3, list(range(11))) == [32, 40]


def test_resumes_right_after_a_changed_line():
    # Lines "1 2 9", "3 4 9", "5 6 9": the answer rewrites the middle one as "8 4 9" and goes on with "5 6 9".
    prediction = [1, 2, 9, 3, 4, 9, 5, 6, 9, 0]
    drafter = begun(prediction)
    drafter.observe_tokens(0, [1, 2, 9, 8, 4, 9])  # lost at 3 (anchor); "4 9" beats the nearer "9" (at 2): 6
    assert (drafter.pos, drafter.agreement, drafter.anchor) == (6, 2, 3)
    assert draft(drafter, 8, list(range(9))) == [5, 6, 9, 0]  # two tokens of agreement: up to four
    drafter.observe_tokens(0, [5, 6])
    assert (drafter.pos, drafter.agreement, drafter.anchor) == (8, 4, 8)


def test_an_inserted_line_goes_on_where_the_prediction_was_lost():
    prediction = [1, 2, 9, 3, 4, 9, 5, 6, 9, 0]
    drafter = begun(prediction)
    drafter.observe_tokens(0, [1, 2, 9, 8, 8, 9])  # "8 8 9" inserted: "9" nearest at the anchor (3)
    assert (drafter.pos, drafter.agreement) == (3, 1) and draft(drafter, 8, list(range(9))) == [3, 4]


def test_a_short_match_never_moves_back_before_the_anchor():
    prediction = [5, 6, 7, 1, 9, 9, 7, 2, 3, 4]
    drafter = begun(prediction)
    drafter.observe_tokens(0, prediction[:8])  # aligned, anchor 8
    drafter.observe_tokens(0, [50, 6, 7])  # "6 7" (two tokens) occurs only before the anchor: no match
    assert drafter.pos is None and drafter.anchor == 8
    drafter.observe_tokens(0, [60, 5, 6, 7])  # "5 6 7" (BACK_MATCH tokens) may go back: index 3
    assert (drafter.pos, drafter.agreement, drafter.anchor) == (3, BACK_MATCH, 8)
    drafter.observe_tokens(0, [50, 51])  # lost again, no match at all: nothing to propose until one comes
    assert drafter.pos is None and draft(drafter, 4, list(range(20))) == []


def test_a_wrong_guess_does_not_move_the_anchor():
    # "7" occurs far ahead (index 10): a one-token guess there, rejected, leaves the search where the answer left.
    prediction = [1, 2, 3, 4, 5, 6, 20, 21, 22, 23, 7, 30]
    drafter = begun(prediction)
    drafter.observe_tokens(0, [1, 2, 3, 99, 7])  # lost at 3, "7" -> 11: a guess
    assert (drafter.pos, drafter.anchor) == (11, 3)
    drafter.observe_tokens(0, [4])  # the guess was wrong; "7 4" is not there but "4" is, at 3: at the anchor
    assert (drafter.pos, drafter.agreement, drafter.anchor) == (4, 1, 3)


def test_the_longest_suffix_wins_over_a_nearer_shorter_one():
    prediction = [3, 9, 1, 1, 4, 9, 5, 5]
    drafter = begun(prediction)
    drafter.observe_tokens(0, [70, 4, 9])  # "9" matches at 1 and 5; "4 9" only at 5
    assert (drafter.pos, drafter.agreement) == (6, 2)


def test_the_prompts_lead_finds_the_start_after_the_answers_preamble():
    # The prompt shows the code after "```python\n" (ids 80 81 82): the answer opens so, then the code starts.
    prompt = [1, 2, 80, 81, 82, 10, 11, 12, 13, 14, 83, 3]
    prediction = [10, 11, 12, 13, 14, 82, 15]
    assert lead_in(prompt, prediction) == [1, 2, 80, 81, 82]
    drafter = begun(prediction, prompt)
    drafter.observe_tokens(0, [80])  # the preamble: the prediction's start was a guess, now lost
    assert drafter.pos is None
    drafter.observe_tokens(0, [81, 82])  # "80 81 82" ends the lead: the prediction starts, confirmed by 3 tokens
    assert (drafter.pos, drafter.agreement) == (0, 3) and draft(drafter, 16, prompt + [80, 81, 82]) == prediction[:7]


def test_without_a_lead_the_start_is_the_guess_until_the_answer_follows():
    drafter = begun([10, 11, 12, 13], prompt=(5, 6))
    assert drafter.lead == []
    drafter.observe_tokens(0, [80, 81])  # a preamble: no match, the start again
    assert (drafter.pos, drafter.agreement) == (0, 0)
    drafter.observe_tokens(0, [10, 11, 99])  # followed, then lost without a match: no guess at the start now
    assert drafter.pos is None


def test_an_occurrence_at_the_very_end_is_no_match():
    drafter = begun([1, 2, 3])
    drafter.observe_tokens(0, [1, 8, 3])  # 3 occurs only last: nothing follows it
    assert drafter.pos is None


def test_route_names_the_guesses_below_sure_tokens_of_agreement_and_the_shared_runs_above():
    drafter = begun([10, 11, 12, 13, 14, 15])
    assert drafter.route(torch.arange(3)) is drafter.guesses and drafter.guesses.name == drafter.name
    drafter.observe_tokens(0, [10, 11, 12][:SURE_TOKENS])
    assert drafter.route(torch.arange(6)) is RUNS and RUNS.name == drafter.name  # one across requests
    assert begun([10, 11, 12]).guesses is not drafter.guesses  # guesses: each request's own
    assert draft_guess(drafter, 2, [0, 1, 2, 10, 11, 12]) == [13, 14]  # the guesses propose through the drafter


def draft_guess(drafter, k, committed):
    return drafter.guesses.propose(draft_batch([committed], [k], vocab=100))[0].token_ids.tolist()


def test_grammar_forced_tokens_in_the_context_move_the_draft_on():
    drafter = begun([10, 11, 12, 13, 14])
    drafter.agreement = SURE_TOKENS  # as after confirmed tokens: the run is not capped
    assert draft(drafter, 2, [0, 1, 2, 10, 11]) == [12, 13]  # two forced tokens the prediction has too
    assert draft(drafter, 2, [0, 1, 2, 10, 99]) == []  # forced tokens it does not have
    assert drafter.pos == 0  # proposing changes no alignment


def test_rows_of_other_sequences_get_nothing():
    drafter = begun([10, 11])
    drafter.agreement = SURE_TOKENS
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
