"""Adaptive draft length: the estimates, the K = 0 / K = max decisions, probing, and the engine wiring."""

import pytest
import torch

from conftest import propose_one, tiny_llama
from gates import virtual_costs
from verispec.engine.policy import AdaptivePolicy
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.build import build_drafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.random import RandomDrafter
from verispec.engine import FixedK, SpeculativeEngine


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add contention


class FixedAlpha(AdaptivePolicy):
    """A policy whose acceptance estimates are given by hand."""

    def __init__(self, alpha, **kwargs):
        super().__init__(len(alpha), **kwargs)
        self._alpha = list(alpha)

    @property
    def alpha(self):
        return self._alpha


def feed(policy, rounds, k, accepted, draft_s_per_token, verify_s):
    """Hand-fed rounds; `verify_s(width)` gives the verify time of each width."""
    for _ in range(rounds):
        policy.record(k, accepted, k * draft_s_per_token, verify_s(k + 1))


def flat(width):
    return 0.010  # a memory-bound target: every width costs the same


def linear(width):
    return 0.010 * (1 + 0.1 * (width - 1))


# -- the model --------------------------------------------------------------------------------------------------


def test_expected_committed_by_hand():
    policy = FixedAlpha([0.5, 0.5, 0.8])
    assert policy.expected_committed(0) == 1.0
    assert policy.expected_committed(1) == pytest.approx(1.5)
    assert policy.expected_committed(2) == pytest.approx(1.75)
    assert policy.expected_committed(3) == pytest.approx(1.75 + 0.25 * 0.8)


def test_expected_cost_and_rates():
    policy = FixedAlpha([0.5, 0.5])
    assert policy.rates() is None and policy.expected_cost(1) is None  # nothing measured yet
    for k in (0, 1, 2):  # the first sample of every timing is a dropped warm-up
        feed(policy, 2, k, 0, 0.002, linear)
    assert policy.verify_cost(3) == pytest.approx(linear(3))
    assert policy.expected_cost(2) == pytest.approx(2 * 0.002 + linear(3))
    assert policy.rates()[1] == pytest.approx(1.5 / (0.002 + linear(2)))


def test_alpha_counts_only_examined_positions_with_chained_prior():
    policy = AdaptivePolicy(4, prior_acceptance=0.6, prior_weight=1.0, decay=1.0)
    policy.record(4, 1, 0.0, 0.01)  # position 1 accepted, position 2 rejected, 3 and 4 never examined
    alpha = policy.alpha
    assert alpha[0] == pytest.approx((1 + 0.6) / 2)
    assert alpha[1] == pytest.approx((0 + alpha[0]) / 2)
    assert alpha[2] == pytest.approx(alpha[1])  # no data: the prior is the estimate one position earlier
    assert alpha[3] == pytest.approx(alpha[1])


def test_verify_curve_is_fitted_and_never_decreasing():
    policy = AdaptivePolicy(8)
    for width, cost in ((1, 0.010), (3, 0.008), (5, 0.014)):  # width 3 measured cheaper than width 1: noise
        for _ in range(2):
            policy.record(width - 1, 0, 0.0, cost)
    curve = [policy.verify_cost(w) for w in range(1, 10)]
    assert curve[0] == pytest.approx(0.010)
    assert curve == sorted(curve)
    assert curve[8] > curve[4]  # extrapolated from the fitted slope


def test_one_outlier_barely_moves_a_timing():
    policy = AdaptivePolicy(4)
    feed(policy, 10, 0, 0, 0.0, flat)
    policy.record(0, 0, 0.0, 5.0)  # one stall of a busy machine: 500 times the usual
    assert policy.verify_cost(1) < 2 * flat(1)


# -- decisions --------------------------------------------------------------------------------------------------


def test_always_rejecting_expensive_drafter_chooses_k0():
    policy = AdaptivePolicy(8, initial_k=4)
    feed(policy, 30, 4, 0, 0.004, linear)  # every draft rejected at position 1; a draft step costs 40% of verify
    feed(policy, 5, 0, 0, 0.0, linear)
    assert policy.best_k() == 0
    assert policy.expected_committed(8) < 1.05


def test_always_rejecting_cheap_drafter_chooses_k0_even_when_verify_looks_free():
    # A free drafter and a flat verify cost: the only thing that could favour K >= 1 is noise in the timings.
    policy = AdaptivePolicy(8, initial_k=4)
    feed(policy, 60, 4, 0, 1e-6, lambda w: 0.010 if w > 1 else 0.011)  # width 1 measured *slower*
    feed(policy, 5, 0, 0, 0.0, lambda w: 0.011)
    assert policy.best_k() == 0


def test_perfect_cheap_drafter_chooses_max():
    policy = AdaptivePolicy(8, initial_k=4)
    feed(policy, 40, 8, 8, 1e-5, linear)  # everything accepted; draft steps cost 0.1% of a verify pass
    feed(policy, 5, 0, 0, 0.0, linear)
    assert policy.best_k() == 8
    assert policy.choose() == 8


def test_good_drafter_with_slow_steps_picks_a_middle_k():
    policy = FixedAlpha([0.8] * 8)
    for k in range(9):
        feed(policy, 2, k, 0, 0.003, linear)  # a draft step costs 30% of a verify pass
    assert 1 <= policy.best_k() < 8


def test_warm_up_then_decisions():
    policy = AdaptivePolicy(8, initial_k=3)
    assert policy.choose() == 3
    policy.record(3, 3, 0.003, 0.012)  # warm-up samples are dropped
    assert policy.choose() == 3
    policy.record(3, 3, 0.003, 0.012)
    assert policy.choose() == 0  # one plain round to time c_verify(1) (its first sample dropped, so twice)
    policy.record(0, 0, 0.0, 0.010)
    assert policy.choose() == 0
    policy.record(0, 0, 0.0, 0.010)
    assert policy.rates() is not None


def test_probes_while_k0_with_back_off_and_recovery():
    policy = AdaptivePolicy(4, initial_k=4, probe_every=4, max_probe_every=16)
    feed(policy, 40, 4, 0, 0.004, linear)
    feed(policy, 3, 0, 0, 0.0, linear)
    choices = []
    for _ in range(60):
        k = policy.choose()
        choices.append(k)
        policy.record(k, 0, k * 0.004, linear(k + 1))
    probes = [i for i, k in enumerate(choices) if k > 0]
    assert probes[:4] == [3, 11, 27, 43]  # after 4, then 8, then 16 (capped) plain rounds
    # The text becomes predictable: probes are accepted in full, and the policy switches speculation back on.
    for _ in range(400):
        k = policy.choose()
        policy.record(k, k, k * 0.0005, linear(k + 1))
        if k > 0 and policy.best_k() > 0:
            break
    assert policy.best_k() > 0


# -- engine wiring ----------------------------------------------------------------------------------------------


def test_engine_keeps_one_policy_per_drafter(tokenizer):
    target = tiny_llama(1)
    drafter = RandomDrafter(target.config.vocab_size)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(adaptive=True, max_speculation_depth=6))
    policy = engine.draft_policy(engine.spec)
    assert isinstance(policy, AdaptivePolicy) and policy.max_depth == 6
    assert engine.draft_policy(engine.spec) is policy
    other = RandomDrafter(target.config.vocab_size)
    assert engine.draft_policy(engine.spec, other) is not policy
    assert isinstance(engine.draft_policy(SpeculativeConfig(adaptive=False)), FixedK)
    engine.generate(tokenizer("the cat")["input_ids"], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert policy.rounds > 0  # the engine recorded its rounds into the shared policy


def test_random_drafter_is_switched_off_and_output_unchanged(tokenizer, monkeypatch):
    target = tiny_llama(2)
    assert isinstance(build_drafter("random", target, tokenizer, 512).drafter, RandomDrafter)
    # A useless drafter that also costs something, like a real draft model: with a free drafter and a free
    # wider verify pass, K = 1 at ~1/vocab acceptance is a genuine (tiny) win and the choice is a coin toss.
    drafter = RandomDrafter(target.config.vocab_size, delay_s=0.003)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(adaptive=True), max_len=256)
    # Costs from a clock the test drives (not this machine's speed): a target forward 5 ms + 0.1 ms a fed token,
    # the drafter 3 ms a draft token.
    virtual_costs(monkeypatch, engine)
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    prompt = tokenizer("Paris is the capital of")["input_ids"]
    alone = engine.generate(prompt, params, use_drafter=False).token_ids
    policy = engine.draft_policy(engine.spec)
    for _ in range(3):
        before = list(policy.chosen)
        assert engine.generate(prompt, params).token_ids == alone
    last = [after - b for after, b in zip(policy.chosen, before)]
    assert last[0] >= 0.75 * sum(last)  # by the third request, plain rounds except for the occasional probe


@pytest.mark.parametrize("adaptive", [False, True])
def test_model_drafter_greedy_equality(tokenizer, adaptive):
    target, draft = tiny_llama(5), tiny_llama(6, layers=1)
    spec = SpeculativeConfig(adaptive=adaptive, speculative_threshold=0.5)
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(draft, 400), spec, max_len=256)
    prompt = tokenizer("one two three")["input_ids"]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    alone = engine.generate(prompt, params, use_drafter=False).token_ids
    for _ in range(2):
        assert engine.generate(prompt, params).token_ids == alone


def test_threshold_stops_drafting_early(tokenizer):
    draft = tiny_llama(6, layers=1)  # untrained: its top probability is far below 0.99
    drafter = ModelDrafter(draft, 128)
    prompt = torch.tensor(tokenizer("the cat sat")["input_ids"])
    vocab = draft.config.vocab_size
    drafter.begin(0, prompt)
    assert propose_one(drafter, prompt, 5, vocab=vocab, threshold=0.99).token_ids.numel() == 1
    drafter.begin(0, prompt)
    assert propose_one(drafter, prompt, 5, vocab=vocab, threshold=0.0).token_ids.numel() == 5


def test_cli_flags_build_the_config():
    import argparse

    from verispec.cli.common import add_model_args, add_speculation_args, spec_kwargs

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_speculation_args(parser)
    defaults = SpeculativeConfig(**spec_kwargs(parser.parse_args([])))
    assert defaults.adaptive and defaults.speculative_threshold == 0.8 and defaults.lossless
    assert SpeculativeConfig().speculative_threshold == 0.0  # off at the library level
    args = parser.parse_args(["--no-adaptive", "--max-speculation-depth", "5", "--speculative-threshold", "0"])
    config = SpeculativeConfig(**spec_kwargs(args))
    assert not config.adaptive and config.max_speculation_depth == 5 and config.speculative_threshold == 0.0


def test_k_falls_under_load():
    """A verify pass costs a fixed part (reading the weights) plus a part per token fed (rows x width): at batch
    size 1 wide verification is nearly free and K is large; at batch 16 every draft position costs 16 tokens of
    compute, so the same acceptance no longer pays and K goes to 0."""
    policy = AdaptivePolicy(max_depth=8)
    per_token = lambda tokens: 0.010 + 0.004 * tokens  # noqa: E731 - seconds of one target pass over `tokens`
    for batch in (1, 16):
        for k in (0, 2, 4, 8, 0, 2, 4, 8):  # each size timed twice (the first sample of a size is dropped)
            rows = [(k, min(k, i % 2)) for i in range(max(batch, 2))]  # half the rows accept one draft token
            policy.record_step(rows, k * 0.001, k, per_token(batch * (k + 1)), batch * (k + 1))
    assert policy.best_k(1) >= 1
    assert policy.best_k(16) == 0
    assert policy.choose(16) == 0  # speculation never costs more than plain decoding under load
    assert policy.verify_cost(16 * 5) > policy.verify_cost(16) > policy.verify_cost(1)


# -- a cascade's stage chosen by tokens per cost (DraftPolicies.route) -------------------------------------------------


def test_route_picks_the_stage_with_the_best_predicted_rate_and_probes_the_other():
    """Pure: two stages whose policies were measured by hand (same verify costs; one accepts 90%, the other 20% at a
    higher draft cost). The router sends rows to the first, unmeasured stages first, and the loser every
    stage_probe_every rounds; with a fixed K the cascade's order decides."""
    from verispec.drafters.cascade import CascadeDrafter
    from verispec.engine.policy import DraftPolicies

    good, bad = RandomDrafter(50), RandomDrafter(50)
    good.name, bad.name = "good", "bad"
    cascade = CascadeDrafter([bad, good])
    spec = SpeculativeConfig(adaptive=True)
    policies = DraftPolicies(stage_probe_every=4)
    tokens = torch.arange(6)
    assert policies.route(spec, cascade, tokens) is bad  # nothing measured: the first stage drafts
    for stage, acceptance, draft_s in ((good, 0.9, 0.001), (bad, 0.2, 0.004)):
        policy = policies.get(spec, stage)
        for _ in range(50):
            k = policy.max_depth
            policy.record_step([(k, int(acceptance * k))], draft_s * k, k, 0.010 + 0.001 * k, k + 1)
            policy.record_step([], 0.0, 0, 0.010, 1)
    routes = [policies.route(spec, cascade, tokens) for _ in range(12)]
    assert routes.count(good) == 9 and routes.count(bad) == 3  # the loser probed every 4th round
    assert [r is bad for r in routes[:4]] == [False, False, False, True]
    assert DraftPolicies().route(SpeculativeConfig(num_draft_tokens=2), cascade, tokens) is bad  # fixed K: order
