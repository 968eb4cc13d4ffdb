"""Predicted outputs in the engine (drafters/prediction.py): the answer equals the target alone's whatever the
prediction (exact, edited, unrelated), under greedy and coupled seeded sampling, alone, in front of an n-gram or a
draft model, with fixed and adaptive K, batched beside requests without one; the prediction's counts by hand on an
answer that leaves the prediction and comes back; negative controls (a wrong alignment changes the counts and not
the answer; an edited prediction is not what comes out)."""

from __future__ import annotations

import pytest

from verispec.config import MAX_DRAFT_TOKENS, SamplingParams, SpeculativeConfig
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters import prediction as prediction_module
from verispec.drafters.prediction import PredictionDrafter
from verispec.engine import SpeculativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 40
TEXTS = ["the cat sat", "one two thr", "Paris is the cap"]
FOREIGN = "Z"  # a character the trained target never writes


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.fixture(scope="module")
def alone(trained_pair, tokenizer, prompts):
    """The target alone's greedy answer to each prompt."""
    engine = SpeculativeEngine(trained_pair[0], tokenizer, None, max_len=256)
    return [engine.generate(p, greedy(), use_drafter=False).token_ids for p in prompts]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, ignore_eos=True, **kwargs)


def coupled(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=1.2, top_k=20, seed=seed, coupled=True)


def edited(answer: list[int], kind: str, foreign: int) -> list[int]:
    """The answer as a client might predict it: exact, with lines inserted, replaced or removed, or unrelated."""
    return {
        "exact": answer,
        "insert": answer[:12] + [foreign] * 5 + answer[12:],
        "replace": answer[:8] + [foreign] * 4 + answer[12:],
        "delete": answer[:10] + answer[16:],
        "truncated": answer[: NEW // 2],
        "unrelated": [foreign, 10, 11, foreign, 12] * 6,
    }[kind]


def drafter_for(name: str, trained_pair):
    return {"none": None, "ngram": NgramDrafter(), "model": ModelDrafter(trained_pair[1], 256)}[name]


@pytest.mark.parametrize("base", ["none", "ngram", "model"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_answer_is_the_target_alone(trained_pair, tokenizer, prompts, alone, base, adaptive):
    foreign = tokenizer.convert_tokens_to_ids(FOREIGN)
    engine = SpeculativeEngine(trained_pair[0], tokenizer, drafter_for(base, trained_pair),
                               SpeculativeConfig(num_draft_tokens=6, adaptive=adaptive), max_len=256)
    accepted = 0
    for prompt, answer in zip(prompts, alone):
        for kind in ("exact", "insert", "replace", "delete", "truncated", "unrelated"):
            prediction = edited(answer, kind, foreign)
            result = engine.generate(prompt, greedy(), prediction=prediction)
            assert result.token_ids == answer, (kind, base, adaptive)
            if kind != "exact":  # unverified drafts would have written the prediction
                assert result.token_ids != prediction[:NEW]
            accepted += result.stats.accepted_by_stage.get("prediction", 0)
            stats = result.stats
            if "prediction" in stats.draft_tokens_by_stage:
                assert stats.accepted_by_stage["prediction"] <= stats.draft_tokens_by_stage["prediction"]
    assert accepted > len(prompts) * NEW  # the prediction drafted most of the answers (the equality is not vacuous)


def test_exact_prediction_drafts_long_runs(trained_pair, tokenizer, prompts, alone):
    """Adaptive K reaches past max_speculation_depth for the prediction's rounds (its policy's ceiling is
    MAX_DRAFT_TOKENS): an exact prediction of 120 tokens takes a handful of rounds."""
    engine = SpeculativeEngine(trained_pair[0], tokenizer, None, SpeculativeConfig(adaptive=True), max_len=512)
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    answer = engine.generate(prompts[0], params, use_drafter=False).token_ids
    for _ in range(3):  # later requests start from the costs earlier predictions measured
        result = engine.generate(prompts[0], params, prediction=answer)
        assert result.token_ids == answer
    assert result.stats.rounds <= 12 and len(result.stats.proposed_by_position) > 8  # a round drafted more than 8
    assert result.stats.accepted_by_stage["prediction"] == result.stats.draft_tokens_by_stage["prediction"]
    policy = engine.policies.get(SpeculativeConfig(adaptive=True), PredictionDrafter([1]))
    assert policy.max_depth == MAX_DRAFT_TOKENS and policy.verify_s  # a new prediction starts with the costs known


@pytest.mark.parametrize("base", ["none", "model"])
def test_coupled_seeded_answer_is_the_target_alone(trained_pair, tokenizer, prompts, base):
    foreign = tokenizer.convert_tokens_to_ids(FOREIGN)
    engine = SpeculativeEngine(trained_pair[0], tokenizer, drafter_for(base, trained_pair),
                               SpeculativeConfig(adaptive=True), max_len=256)
    accepted = 0
    for i, prompt in enumerate(prompts):
        answer = engine.generate(prompt, coupled(7 + i), use_drafter=False).token_ids
        for kind in ("exact", "replace", "unrelated"):
            result = engine.generate(prompt, coupled(7 + i), prediction=edited(answer, kind, foreign))
            assert result.token_ids == answer, (kind, base)
            accepted += result.stats.accepted_by_stage.get("prediction", 0)
    assert accepted > len(prompts) * NEW


def test_batched_beside_requests_without_a_prediction(trained_pair, tokenizer, prompts, alone):
    """Rows with and without a prediction in one batch (an n-gram engine drafter for the others); greedy and coupled
    rows; each answer as the target alone's."""
    foreign = tokenizer.convert_tokens_to_ids(FOREIGN)
    engine = SpeculativeEngine(trained_pair[0], tokenizer, NgramDrafter(), SpeculativeConfig(adaptive=True),
                               max_len=256, max_batch_size=8)
    seeded = [engine.generate(p, coupled(3), use_drafter=False).token_ids for p in prompts]
    batch_prompts = prompts + prompts
    params = [greedy()] * 3 + [coupled(3)] * 3
    predictions = [edited(alone[0], "replace", foreign), None, edited(alone[2], "exact", foreign),
                   None, edited(seeded[1], "insert", foreign), seeded[2]]
    results = engine.generate_batch(batch_prompts, params, predictions=predictions)
    assert [r.token_ids for r in results] == alone + seeded
    assert all("prediction" not in r.stats.rounds_by_stage for r, p in zip(results, predictions) if p is None)
    assert all(r.stats.accepted_by_stage["prediction"] > 0 for r, p in zip(results, predictions) if p is not None)


def hand_case(tokenizer, answer: list[int]) -> tuple[int, list[int]]:
    """(a, prediction): the answer with three foreign tokens inserted before answer[a], where the pair
    answer[a - 1 : a + 1] occurs nowhere else in the answer, so the one place the prediction goes on after answer[a]
    is right after the inserted tokens."""
    foreign = tokenizer.convert_tokens_to_ids(FOREIGN)
    assert foreign not in answer
    pairs = [tuple(answer[i : i + 2]) for i in range(len(answer) - 1)]
    a = next(a for a in range(8, len(answer) - 8) if pairs.count(tuple(answer[a - 1 : a + 1])) == 1)
    return a, answer[:a] + [foreign] * 3 + answer[a:]


def test_prediction_counts_by_hand(trained_pair, tokenizer, prompts, alone, monkeypatch):
    """Fixed K = 64 (more than the answer) and no cap on a round's run (`run_cap`, tested by hand in
    tests/drafters/test_prediction_align.py): each round drafts what is left of the answer. N = 40 answer tokens.
    Round 1 drafts prediction[0 : N - 1]: the first a are accepted, then the inserted token is rejected (the
    recovered token is answer[a]), so N - 1 - a are rejected. The alignment is lost at a and found again right after
    the inserted tokens (answer[a] occurs there after a foreign token; the pair answer[a - 1 : a + 1] nowhere else).
    Round 2 drafts the N - a - 2 tokens answer[a + 1 : N - 1], all accepted, and the bonus token ends the answer.
    Accepted: a + N - a - 2 = N - 2; rejected: N - 1 - a; proposed = accepted + rejected; two rounds."""
    monkeypatch.setattr(prediction_module, "run_cap", lambda agreement: MAX_DRAFT_TOKENS)
    engine = SpeculativeEngine(trained_pair[0], tokenizer, None,
                               SpeculativeConfig(num_draft_tokens=MAX_DRAFT_TOKENS, adaptive=False), max_len=256)
    answer = alone[0]
    a, prediction = hand_case(tokenizer, answer)
    result = engine.generate(prompts[0], greedy(), prediction=prediction)
    stats = result.stats
    assert result.token_ids == answer
    assert stats.rounds == 2
    assert stats.accepted_by_stage["prediction"] == NEW - 2
    assert stats.draft_tokens_by_stage["prediction"] - stats.accepted_by_stage["prediction"] == NEW - 1 - a


def test_negative_control_a_wrong_alignment_changes_the_counts_not_the_answer(trained_pair, tokenizer, prompts,
                                                                             alone, monkeypatch):
    """A deliberately wrong alignment (found again one token too far on) drafts the wrong tokens: the counts of
    the hand case change (so that test can fail), the answer stays the target's (the target verified them)."""
    find = PredictionDrafter.find

    def one_too_far(self, suffix, anchor):
        pos, size = find(self, suffix, anchor)
        return (None if pos is None else pos + 1), size

    monkeypatch.setattr(PredictionDrafter, "find", one_too_far)
    monkeypatch.setattr(prediction_module, "run_cap", lambda agreement: MAX_DRAFT_TOKENS)
    engine = SpeculativeEngine(trained_pair[0], tokenizer, None,
                               SpeculativeConfig(num_draft_tokens=MAX_DRAFT_TOKENS, adaptive=False), max_len=256)
    _, prediction = hand_case(tokenizer, alone[0])
    result = engine.generate(prompts[0], greedy(), prediction=prediction)
    assert result.token_ids == alone[0]
    assert result.stats.accepted_by_stage["prediction"] < NEW - 2 and result.stats.rounds > 2


def test_bad_predictions_are_refused_naming_the_fix(trained_pair, tokenizer, prompts):
    engine = SpeculativeEngine(trained_pair[0], tokenizer, None, max_len=64)
    with pytest.raises(ValueError, match="prediction is empty"):
        engine.add_request(prompts[0], greedy(), prediction=[])
    with pytest.raises(ValueError, match="shorten the prediction or raise max_len"):
        engine.add_request(prompts[0], SamplingParams(max_new_tokens=8), prediction=[10] * 60)
    assert not engine.has_unfinished
