"""Token trees from a draft model (drafters/model_tree.py), exact under greedy and sampling.

Level (c): greedy tree speculation with the draft model equals the target alone (ragged batches, both runners), and
a seeded coupled request gives the target alone's tokens. Level (b): the sampled output of the tiny-vocabulary pair
through the engine, the draft model growing trees whose siblings are drawn without replacement, follows the exact
target distribution (the enumeration and TVD bound of test_sampling_exactness.py); the same check fails when the
children carry the draft's q instead of the renormalised q they were drawn from.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from test_sampling_exactness import (NEW_TOKENS, VOCAB, CharTokenizer, _sample, exact_joint, peaky_llama,
                                     tvd_bound)
from verispec.config import RunnerOptions, SamplingParams, SpeculativeConfig
from verispec.drafters import model_tree
from verispec.drafters.model import ModelDrafter
from verispec.engine import CACHE_SLACK, SpeculativeEngine

TEXTS = ["the cat sat on", "one two three", "Paris is the", "a"]


def spying(drafter: ModelDrafter) -> list[list]:
    """Every proposal list `drafter` makes, in order (the drafter's propose wrapped)."""
    seen: list[list] = []
    propose = drafter.propose

    def logged(batch):
        seen.append(propose(batch))
        return seen[-1]

    drafter.propose = logged
    return seen


@pytest.mark.parametrize("backend", ["default", "hf"])
def test_greedy_model_trees_equal_the_target_alone(trained_pair, tokenizer, backend):
    """A batch of ragged prompts (more than the slots), trees of 8 nodes at depth 4: token-identical to the target
    alone, trees proposed, and more tokens per round than the draft model's chains. "default": the suite's runner
    (native, or VERISPEC_TEST_RUNNER's)."""
    target, draft = trained_pair
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    accepted = {}
    for nodes in (0, 8):
        drafter = ModelDrafter(draft, 256 + CACHE_SLACK)
        seen = spying(drafter)
        engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=4, tree_nodes=nodes),
                                   max_len=256, max_batch_size=3,
                                   runner=RunnerOptions(backend="hf") if backend == "hf" else None)
        alone = engine.generate_batch(prompts, params, use_drafter=False)
        out = engine.generate_batch(prompts, params)
        assert [r.token_ids for r in out] == [r.token_ids for r in alone], nodes
        assert any(p.is_tree for step in seen for p in step) == bool(nodes)
        accepted[nodes] = sum(r.stats.mean_accepted_length for r in out) / len(out)
    assert accepted[8] > accepted[0], accepted


def test_seeded_coupled_request_with_model_trees_equals_the_target_alone(trained_pair, tokenizer):
    """Coupled sampling (the seed's noise): the draft model's trees (its coupled choice as the first child) change
    only the speed, never the tokens; several seeds, ragged rows side by side."""
    target, draft = trained_pair
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS[:3]]
    drafter = ModelDrafter(draft, 256 + CACHE_SLACK)
    seen = spying(drafter)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=4, tree_nodes=10),
                               max_len=256, max_batch_size=3)
    for seed in (1, 2):
        params = [SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0.8, top_p=0.95, seed=seed + i)
                  for i in range(len(prompts))]
        out = engine.generate_batch(prompts, params)
        alone = engine.generate_batch(prompts, params, use_drafter=False)
        assert [r.token_ids for r in out] == [r.token_ids for r in alone], seed
    assert any(p.is_tree for step in seen for p in step)


def test_trees_only_for_rows_whose_processing_allows_them(trained_pair, tokenizer):
    """A penalised row (its logits depend on the drafts before each position) drafts chains beside a tree row of the
    same step, from the same draft forwards; both stay equal to the target alone."""
    target, draft = trained_pair
    drafter = ModelDrafter(draft, 256 + CACHE_SLACK)
    seen = spying(drafter)
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=4, tree_nodes=10),
                               max_len=256, max_batch_size=2)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True),
              SamplingParams(max_new_tokens=30, ignore_eos=True, repetition_penalty=1.3)]
    out = engine.generate_batch(prompts, params)
    assert [r.token_ids for r in out] == [r.token_ids for r in engine.generate_batch(prompts, params,
                                                                                      use_drafter=False)]
    both = [step for step in seen if len(step) == 2]
    assert any(step[0].is_tree for step in both)
    assert not any(step[1].is_tree for step in both) and any(step[1].token_ids.numel() for step in both)


def test_sampled_tree_shape_is_fixed_from_what_is_known_before_drawing():
    """`_slots`: an even share of the budget per depth, to the (node, rank) pairs of highest estimated score, each
    node's ranks in order; with measured verify costs, only while a pair raises tokens per verify cost."""
    top_p = [[0.6, 0.3, 0.1, 0.0], [0.5, 0.5, 0.0, 0.0]]  # q's sorted top probabilities below two frontier nodes
    scores = [math.log(0.5), math.log(0.25)]  # their paths' scores: pair values 0.3, 0.15, 0.05 and 0.125, 0.125
    assert model_tree._slots(top_p, scores, 8, 2, 4, [], None) == [2, 2]  # share 4 of 8 over 2 depths
    assert model_tree._slots(top_p, scores, 8, 4, 4, [], None) == [2, 0]  # share 2
    assert model_tree._slots(top_p, scores, 8, 2, 1, [], None) == [1, 1]  # branch 1: rank 0 only
    assert model_tree._slots(top_p, scores, 8, 2, 4, [], lambda width: 1.0) == [2, 2]  # width is free: all
    assert model_tree._slots(top_p, scores, 8, 2, 4, [], lambda width: float(width)) == [0, 0]  # none pays
    assert model_tree._slots(top_p, scores, 8, 2, 4, [], lambda width: None) == [2, 2]  # not measured yet


# -- sampling: the distribution ------------------------------------------------------------------------------------

SAMPLES = 3000
FIRST = 2  # tokens compared: VOCAB**FIRST outcomes
TREE_PARAMS = {"model-tree-sampled": SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.1, top_p=0.97,
                                                    logit_bias={2: 0.6})}


def sampled_tree_tvd(samples: int = SAMPLES) -> tuple[float, float, float]:
    """-> (TVD of the first FIRST tokens, acceptance rate, draft tokens per round): the tiny-vocabulary pair, a
    draft model that disagrees with the target proposing trees of 5 nodes at depth 2, `samples` seeded rows."""
    target = peaky_llama(0)
    drafter = ModelDrafter(peaky_llama(1), 128)
    seen = spying(drafter)
    engine = SpeculativeEngine(target, CharTokenizer(), None, SpeculativeConfig(num_draft_tokens=2), 64,
                               max_batch_size=32)
    cases = {case: replace(params, coupled=False) for case, params in TREE_PARAMS.items()}
    specs = {case: SpeculativeConfig(num_draft_tokens=2, tree_nodes=5) for case in cases}
    counts, stats = _sample(engine, cases, {case: drafter for case in cases}, samples, specs)
    (case, params), = cases.items()
    exact, seen_first = {}, {}  # both folded onto the first FIRST tokens
    for tokens, p in exact_joint(target, params).items():
        exact[tokens[:FIRST]] = exact.get(tokens[:FIRST], 0.0) + p
    for tokens, count in counts[case].items():
        seen_first[tokens[:FIRST]] = seen_first.get(tokens[:FIRST], 0) + count
    tvd = 0.5 * sum(abs(seen_first.get(s, 0) / samples - p) for s, p in exact.items())
    # Siblings were drawn: more than one child below some node, each carrying its own q.
    assert any(p.is_tree and p.probs is not None and p.token_ids.numel() > p.depth for step in seen for p in step)
    return tvd, stats[case].acceptance_rate, stats[case].draft_tokens / max(stats[case].rounds, 1)


def test_sampled_model_trees_follow_the_target_distribution():
    tvd, acceptance, per_round = sampled_tree_tvd()
    bound = tvd_bound(VOCAB**FIRST, SAMPLES)
    print(f"model trees: TVD {tvd:.4f}, bound {bound:.4f}, acceptance {acceptance:.3f}, drafts/round {per_round:.2f}")
    assert 0.05 < acceptance < 0.9, "both the draft path and the residual path must run"
    assert per_round > 2.5, f"trees were not drafted ({per_round:.2f} draft tokens per round)"
    assert tvd < bound, f"TVD {tvd:.4f} exceeds the sampling bound {bound:.4f}"


def test_the_check_catches_siblings_carrying_the_wrong_q(monkeypatch):
    """Siblings drawn without replacement but each carrying the draft's q instead of the renormalised q it was drawn
    from: the verifier's ratio p / q is then wrong for every sibling after the first, and the check must fail."""
    draw = model_tree.without_replacement

    def wrong_q(q, uniform):
        tokens, carried = draw(q, uniform)
        return tokens, [q] * len(carried)

    monkeypatch.setattr(model_tree, "without_replacement", wrong_q)
    tvd, _, _ = sampled_tree_tvd()
    bound = tvd_bound(VOCAB**FIRST, SAMPLES)
    print(f"siblings with the wrong q: TVD {tvd:.4f}, bound {bound:.4f}")
    assert tvd > bound, f"a biased tree passed: TVD {tvd:.4f} <= bound {bound:.4f}"
