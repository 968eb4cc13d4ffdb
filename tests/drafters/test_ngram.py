"""The n-gram (prompt-lookup) drafter: hand-built matches, greedy equality, and exact sampling with probs=None."""

import pytest
import torch

from conftest import chisquare_pvalue, propose_one, sample_first_tokens, tiny_llama
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.named import NAMED_DRAFTERS
from verispec.drafters.build import build_drafter
from verispec.drafters.ngram import NgramDrafter, continuation, find_match, recurs
from verispec.engine import SpeculativeEngine
from verispec.engine.acceptance import rejection_verify


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add contention


def ids(*tokens):
    return torch.tensor(tokens, dtype=torch.long)


def propose(tokens, k, **kwargs):
    return propose_one(NgramDrafter(**kwargs), ids(*tokens), k, vocab=100).token_ids.tolist()


# -- hand-built matches -----------------------------------------------------------------------------------------


def test_find_match_longest_then_latest():
    # suffix [2, 3]: the 2-gram occurs at 1..2 (continuation 9) and 5..6 (continuation 7); latest wins.
    assert find_match(ids(1, 2, 3, 9, 4, 2, 3, 7, 2, 3), 3) == (2, 7)
    # suffix [1, 2, 3] occurs at 0..2 (3-gram) and [2, 3] also at 6..7: the longer match wins over the later one.
    assert find_match(ids(1, 2, 3, 8, 5, 0, 2, 3, 6, 1, 2, 3), 3) == (3, 3)
    # capped at max_ngram: with max_ngram=2 the later 2-gram wins.
    assert find_match(ids(1, 2, 3, 8, 5, 0, 2, 3, 6, 1, 2, 3), 2) == (2, 8)


def test_find_match_none_and_min_ngram():
    assert find_match(ids(1, 2, 3, 4), 3) == (0, 0)  # nothing recurs
    assert find_match(ids(5), 3) == (0, 0)  # too short to hold an earlier occurrence
    assert find_match(ids(), 3) == (0, 0)
    # only the 1-gram [4] recurs: found with min_ngram=1, refused with min_ngram=2
    assert find_match(ids(4, 7, 1, 4), 3, min_ngram=1) == (1, 1)
    assert find_match(ids(4, 7, 1, 4), 3, min_ngram=2) == (0, 0)


def test_recurs_is_whether_find_match_finds_one():
    """can_propose's shortcut: the min_ngram-suffix recurs iff find_match finds a match of >= min_ngram tokens."""
    generator = torch.Generator().manual_seed(0)
    cases = [ids(), ids(5), ids(3, 3), ids(9, 9, 9), ids(4, 7, 1, 4), ids(1, 2, 3, 4)]
    cases += [torch.randint(0, vocab, (n,), generator=generator) for vocab in (2, 3, 5, 40) for n in range(0, 30)]
    for tokens in cases:
        for min_ngram in (1, 2, 3):
            for max_ngram in range(min_ngram, 5):
                assert recurs(tokens, min_ngram) == (find_match(tokens, max_ngram, min_ngram)[0] > 0), \
                    (tokens.tolist(), min_ngram, max_ngram)


def test_find_match_never_matches_the_suffix_itself_or_padding():
    # the only occurrence of [9, 9] is the suffix itself... and the overlapping one at 0..1, continuation 9
    assert find_match(ids(9, 9, 9), 3) == (2, 2)
    # sequences shorter than max_ngram: padding must not pair with padding
    assert find_match(ids(3, 3), 3) == (1, 1)
    assert find_match(ids(1, 2), 3) == (0, 0)


def test_continuation_and_periodic_extension():
    seq = ids(1, 2, 3, 9, 4, 2, 3, 7, 2, 3)
    assert continuation(seq, 7, 2).tolist() == [7, 2]
    # the continuation runs into the matched suffix: a repetition of period 3 (a b c a b -> c a b c ...)
    assert continuation(ids(5, 6, 7, 5, 6), 2, 5).tolist() == [7, 5, 6, 7, 5]


def test_propose_by_hand():
    assert propose([1, 2, 3, 9, 4, 2, 3, 7, 2, 3], k=3) == [7, 2, 3]
    assert propose([1, 2, 3, 9, 4, 2, 3, 7, 2, 3], k=1) == [7]
    assert propose([1, 2, 3, 4], k=4) == []
    assert propose([5, 6, 7, 5, 6], k=4) == [7, 5, 6, 7]
    assert propose([8, 1, 2, 8, 3, 1, 2], k=2, max_ngram=1) == [8, 3]  # only the last token is matched
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(max_ngram=1, min_ngram=2)


def test_registered_for_any_target():
    target = tiny_llama(1)
    assert "ngram" in NAMED_DRAFTERS
    drafter = build_drafter("ngram", target, None, 128).drafter
    assert isinstance(drafter, NgramDrafter) and not drafter.provides_probs


# -- end to end -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_equals_target_alone(tokenizer, adaptive):
    target = tiny_llama(3)
    engine = SpeculativeEngine(target, tokenizer, NgramDrafter(), SpeculativeConfig(adaptive=adaptive), max_len=256)
    for text in ["the cat sat on the mat. the cat sat on the", "one two three one two three one"]:
        prompt = tokenizer(text)["input_ids"]
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        spec = engine.generate(prompt, params)
        alone = engine.generate(prompt, params, use_drafter=False)
        assert spec.token_ids == alone.token_ids
    assert engine.total.draft_tokens > 0  # the drafter did propose (untrained models repeat themselves)


def test_sampling_uses_point_mass_verification(tokenizer, monkeypatch):
    """Under sampling, the n-gram drafter's proposals are verified with q = None (a point mass)."""
    import verispec.engine.verifier as engine_module

    seen = []

    def spy(meta, q, has_q, p, *args, **kwargs):
        seen.append((meta.draft_token_ids.shape[1], None if q is None or not has_q.any() else q))
        return rejection_verify(meta, q, has_q, p, *args, **kwargs)

    monkeypatch.setattr(engine_module, "rejection_verify", spy)
    engine = SpeculativeEngine(tiny_llama(3), tokenizer, NgramDrafter(), SpeculativeConfig(num_draft_tokens=3))
    prompt = tokenizer("one two one two one two one")["input_ids"]
    engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=1.0, seed=0, ignore_eos=True, coupled=False))
    assert any(k > 0 for k, _ in seen)
    assert all(q is None for _, q in seen)


def test_sampled_first_token_follows_the_target(tokenizer):
    """Level (b): with a draft proposed every time, the first sampled token still follows the target's p."""
    target = tiny_llama(4)
    prompt = tokenizer("ab ab ab ab a")["input_ids"]
    engine = SpeculativeEngine(target, tokenizer, NgramDrafter(), SpeculativeConfig(num_draft_tokens=1))
    runs = 400
    counts, p = sample_first_tokens(engine, target, prompt, temperature=1.5, runs=runs)
    assert engine.total.draft_tokens == runs  # the drafter proposed "b" in every run
    # Chi-square over the likely tokens (expected count >= 5), the rest pooled.
    assert chisquare_pvalue(counts, p) > 1e-3
