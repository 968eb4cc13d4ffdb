"""Suffix decoding: the trie by hand (incremental = whole-text, removal, chains and trees), the cache's LRU bound,
scope isolation and thread safety, then the engine: greedy identity, batch equality and exact sampling (point mass),
cross-request drafting, and the tokens-per-cost choice of a cascade's stage."""

import random
import threading

import pytest
import torch

from conftest import chisquare_pvalue, propose_one, sample_first_tokens, tiny_llama
from gates import virtual_costs
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.cascade import CascadeDrafter
from verispec.drafters.named import NAMED_DRAFTERS
from verispec.drafters.build import build_drafter
from verispec.drafters.random import RandomDrafter
from verispec.drafters.suffix import SuffixDrafter
from verispec.drafters.suffix_tree import SuffixCache, SuffixTrie
from verispec.engine import SpeculativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]


def shape(node):
    """A trie as nested {token: (count, children)}, for comparing two tries."""
    return {token: (kid.count, shape(kid)) for token, kid in (node.kids or {}).items()}


# -- the trie by hand ---------------------------------------------------------------------------------------------


def test_incremental_extend_builds_the_same_trie_as_a_whole_text():
    rng = random.Random(0)
    text = [rng.randrange(5) for _ in range(200)]
    grown, whole = SuffixTrie(6), SuffixTrie(6)
    for start in range(0, len(text), 7):  # committed a few tokens a round
        grown.extend(text[start : start + 7])
    whole.add(text)
    assert shape(grown.root) == shape(whole.root) and grown.nodes == whole.nodes
    whole.remove(text)
    assert whole.nodes == 0 and whole.root.count == 0 and whole.root.kids is None


def test_chain_follows_the_most_frequent_continuation_while_confident():
    trie = SuffixTrie(8)
    trie.extend(TEXT)
    # "1 2" was followed by 3 twice; after "1 2 3", 4 and 5 once each (0.5): 4 wins the tie by insertion order.
    draft = trie.draft(TEXT, 4, 0.1, 6)
    assert draft.tokens == [3, 4, 1, 2] and draft.match == 2 and draft.score == pytest.approx(2.5)
    assert trie.draft(TEXT, 4, 0.6, 6).tokens == [3]  # the 0.5 branch falls under the confidence threshold
    assert trie.draft(TEXT, 1, 0.1, 6).tokens == [3]
    assert trie.draft([9, 9], 4, 0.1, 6).tokens == []  # nothing matches
    # spec_factor caps the depth at that many times the match: the 2-token match may draft 2 (x1) or 3 (x1.5).
    assert trie.draft(TEXT, 4, 0.1, 6, spec_factor=1.0).tokens == [3, 4]
    assert trie.draft(TEXT, 4, 0.1, 6, spec_factor=1.5).tokens == [3, 4, 1]


def test_tree_expands_the_most_probable_continuations_parents_first():
    trie = SuffixTrie(8)
    trie.extend(TEXT)
    draft = trie.draft(TEXT, 3, 0.1, 6, tree_nodes=5)
    assert draft.tokens[:3] == [3, 4, 5] and draft.parents[:3] == [0, 1, 1]  # both branches after "1 2 3"
    assert len(draft.tokens) == 5 and all(p <= i for i, p in enumerate(draft.parents))
    depths = [0]
    for parent in draft.parents:
        depths.append(depths[parent] + 1)
    assert max(depths) <= 3


# -- the cache: LRU bound, scopes, threads ---------------------------------------------------------------------------


def test_cache_evicts_least_recently_added_requests_within_its_token_bound():
    cache = SuffixCache(max_tokens=25, depth=8)
    first, second, third = [10, 11, 12, 13] * 3, [20, 21, 22, 23] * 3, [30, 31, 32, 33] * 3
    for text in (first, second):
        cache.add("", text)
    assert cache.tokens == 24 and cache.draft("", [10, 11], 2, 0.1, 6).tokens == [12, 13]
    cache.add("", third)  # 36 > 25: the oldest text goes
    assert cache.tokens == 24 and cache.stats()["requests"] == 2
    assert cache.draft("", [10, 11], 2, 0.1, 6).tokens == []
    assert cache.draft("", [30, 31], 2, 0.1, 6).tokens == [32, 33]
    cache.add("", list(range(100, 200)))  # longer than the bound: only its last 25 tokens are kept
    assert cache.tokens == 25 and cache.stats()["requests"] == 1


def test_scopes_never_draft_from_each_other():
    cache = SuffixCache(max_tokens=1000)
    cache.add("tenant-a", [5, 6, 7, 8, 9] * 2)
    assert cache.draft("tenant-a", [5, 6], 3, 0.1, 6).tokens == [7, 8, 9]
    assert cache.draft("tenant-b", [5, 6], 3, 0.1, 6).tokens == []
    # Through the drafter: a request in scope b sees only its own text, then a's request's text once in scope a.
    drafter = SuffixDrafter(cache)
    drafter.set_scope(0, "tenant-b")
    drafter.begin(0, torch.tensor([1, 5, 6]))
    assert propose_one(drafter, torch.tensor([1, 5, 6]), 3).token_ids.tolist() == []
    drafter.release(0)
    drafter.set_scope(0, "tenant-a")
    drafter.begin(0, torch.tensor([1, 5, 6]))
    assert propose_one(drafter, torch.tensor([1, 5, 6]), 3).token_ids.tolist() == [7, 8, 9]


def test_cache_under_concurrent_writers_and_readers_stays_consistent():
    """Threads add, evict and draft at once; afterwards the trie equals one built from the texts it kept (no lost or
    torn update). No timing: every thread runs its fixed amount of work to the end."""
    cache = SuffixCache(max_tokens=400, depth=6)
    errors = []

    def writer(seed):
        rng = random.Random(seed)
        try:
            for _ in range(60):
                cache.add(f"s{seed % 2}", [rng.randrange(8) for _ in range(rng.randrange(5, 40))])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader(seed):
        rng = random.Random(seed)
        try:
            for _ in range(300):
                draft = cache.draft(f"s{seed % 2}", [rng.randrange(8) for _ in range(6)], 4, 0.0, 4, tree_nodes=6)
                assert len(draft.tokens) <= 6
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert cache.tokens <= 400 and cache.tokens == sum(len(t) for _, t in cache._texts.values())
    for scope, trie in cache._tries.items():
        rebuilt = SuffixTrie(6)
        for text_scope, text in cache._texts.values():
            if text_scope == scope:
                rebuilt.add(text)
        assert shape(trie.root) == shape(rebuilt.root) and trie.nodes == rebuilt.nodes


# -- the engine -------------------------------------------------------------------------------------------------------


def test_cascade_stage_gives_way_after_a_one_token_match():
    """In a cascade the suffix stage drafts only after a match of >= cascade_min_match tokens (own text or its
    scope's cache); after a one-token match the next stage drafts. Control: with cascade_min_match=1 it keeps it."""
    weak = [1, 2, 3, 4, 1, 2, 3, 5, 7, 3]  # "3" recurs, "7 3" does not: a one-token match
    strong = TEXT  # "1 2" recurs with a continuation: a two-token match
    for min_match, expect_weak in ((2, False), (1, True)):
        drafter = SuffixDrafter(SuffixCache(4096), cascade_min_match=min_match)
        other = RandomDrafter(16)
        cascade = CascadeDrafter([drafter, other])
        drafter.begin(0, torch.tensor(weak))
        drafter.begin(1, torch.tensor(strong))
        assert drafter.can_propose(torch.tensor(weak)) is expect_weak
        assert cascade.route(torch.tensor(weak)) is (drafter if expect_weak else other)
        assert drafter.can_propose(torch.tensor(strong)) and cascade.route(torch.tensor(strong)) is drafter
    # The scope's cache counts too: an earlier request that said "7 3 9" makes the weak row's match two tokens.
    drafter = SuffixDrafter(SuffixCache(4096))
    drafter.begin(0, torch.tensor([7, 3, 9]))
    drafter.release(0)
    drafter.begin(0, torch.tensor(weak))
    assert drafter.can_propose(torch.tensor(weak))
    assert drafter.can_propose(torch.tensor([5, 6]))  # not a sequence it holds: the row's own draft decides
    with pytest.raises(ValueError, match="cascade_min_match"):
        SuffixDrafter(SuffixCache(0), cascade_min_match=0)


def test_registered_by_name():
    assert "suffix" in NAMED_DRAFTERS
    drafter = build_drafter("suffix", tiny_llama(1), None, 128).drafter
    assert isinstance(drafter, SuffixDrafter) and not drafter.provides_probs
    cascade = build_drafter("suffix+ngram", tiny_llama(1), None, 128).drafter
    assert [stage.name for stage in cascade.stages] == ["suffix", "ngram"] and cascade.wants_tokens


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_equals_target_alone_and_later_requests_draft_from_earlier_ones(tokenizer, adaptive):
    target = tiny_llama(3)
    drafter = SuffixDrafter(SuffixCache(4096))
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(adaptive=adaptive), max_len=256)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for text in ["the cat sat on the mat. the cat sat on the", "one two three one two three one", "the cat"]:
        prompt = tokenizer(text)["input_ids"]
        alone = engine.generate(prompt, params, use_drafter=False)
        assert engine.generate(prompt, params).token_ids == alone.token_ids
    assert engine.total.accepted_tokens > 0
    assert drafter.drafted_from["cache"] > 0  # "the cat" repeats what an earlier request generated
    assert drafter.cache.stats()["requests"] == 3 and not drafter._requests  # released, nothing left per slot


def test_batch_rows_equal_their_prompt_alone(tokenizer):
    target = tiny_llama(3)
    engine = SpeculativeEngine(target, tokenizer, SuffixDrafter(SuffixCache(4096)), SpeculativeConfig(),
                               max_len=256, max_batch_size=3)
    prompts = [tokenizer(t)["input_ids"] for t in ["a b a b a b", "the cat sat on the mat. the cat", "x y z x y",
                                                   "one two one two one"]]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    alone = [engine.generate(p, params, use_drafter=False).token_ids for p in prompts]
    assert [r.token_ids for r in engine.generate_batch(prompts, params)] == alone  # 4 rows through 3 slots


def test_sampled_first_token_follows_the_target(tokenizer):
    """Level (b): a point-mass draft proposed every run; the first sampled token still follows the target's p."""
    target = tiny_llama(4)
    prompt = tokenizer("ab ab ab ab a")["input_ids"]
    engine = SpeculativeEngine(target, tokenizer, SuffixDrafter(SuffixCache(0)), SpeculativeConfig(num_draft_tokens=1))
    runs = 400
    counts, p = sample_first_tokens(engine, target, prompt, temperature=1.5, runs=runs)
    assert engine.total.draft_tokens == runs
    assert chisquare_pvalue(counts, p) > 1e-3


def test_cascade_picks_the_stage_with_more_tokens_per_cost(tokenizer, monkeypatch):
    """Both stages can always propose; the free suffix stage on a repeating target beats a costly random stage by
    tokens per cost, so after measuring both the router sends nearly every round to suffix decoding."""
    target = tiny_llama(3)
    suffix = SuffixDrafter(SuffixCache(4096), min_prob=0.0)
    costly = RandomDrafter(target.config.vocab_size, delay_s=0.003)
    cascade = CascadeDrafter([costly, suffix])  # the costly stage first: order alone would always pick it
    engine = SpeculativeEngine(target, tokenizer, cascade, SpeculativeConfig(adaptive=True), max_len=256)
    virtual_costs(monkeypatch, engine)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    prompt = tokenizer("the cat sat on the mat. the cat")["input_ids"]
    alone = engine.generate(prompt, params, use_drafter=False).token_ids
    for _ in range(3):
        assert engine.generate(prompt, params).token_ids == alone
    drafted = engine.total.rounds_by_stage  # rounds each stage drafted, over the three requests
    assert drafted["random"] > 0  # measured once it was tried
    assert drafted["suffix"] > 5 * drafted["random"], drafted


def test_engine_scopes_keep_tenants_apart(tokenizer):
    """A request of scope b never drafts from scope a's finished requests; a second request of scope a does."""
    target = tiny_llama(3)
    drafter = SuffixDrafter(SuffixCache(4096))
    engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=4), max_len=256)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    first = tokenizer("a quick brown fox")["input_ids"]
    seq = engine.add_request(first, params, scope="a")
    while not seq.finished:
        engine.step()
    again = list(first) + seq.stopper.token_ids[:3]  # asks the same again, with the start of the answer
    for scope, expect_cache in (("b", False), ("a", True)):
        drafter.drafted_from["cache"] = 0
        seq = engine.add_request(again, params, scope=scope)
        while not seq.finished:
            engine.step()
        assert (drafter.drafted_from["cache"] > 0) is expect_cache, scope
    assert set(drafter.cache._tries) == {"a", "b"}


def test_token_trees_equal_target_alone_and_stages_are_counted(tokenizer):
    target = tiny_llama(3)
    suffix = SuffixDrafter(SuffixCache(4096), min_prob=0.0)
    cascade = CascadeDrafter([suffix, RandomDrafter(target.config.vocab_size)])
    trees = []
    propose = suffix.propose
    suffix.propose = lambda batch: [trees.append(p.is_tree and p.token_ids.numel() > p.depth) or p
                                    for p in propose(batch)]
    engine = SpeculativeEngine(target, tokenizer, cascade, SpeculativeConfig(num_draft_tokens=3, tree_nodes=8),
                               max_len=256)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for text in ["the cat sat on the mat. the cat sat on the", "the cat sat"]:
        prompt = tokenizer(text)["input_ids"]
        alone = engine.generate(prompt, params, use_drafter=False)
        assert engine.generate(prompt, params).token_ids == alone.token_ids
    assert engine.total.rounds_by_stage.get("suffix", 0) > 0
    assert sum(engine.total.rounds_by_stage.values()) <= engine.total.rounds
    assert any(trees)  # branching token trees were proposed and verified
