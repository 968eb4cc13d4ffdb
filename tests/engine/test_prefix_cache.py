"""Automatic prefix caching (runtime/caches/prefix_cache.py): a request that starts from cached prefix blocks gets what it
gets without them. Each case runs the same requests on an engine with prefix caching and on one without, and
checks that hits happened (so the test cannot pass by never hitting).

Tokens are compared with torch.equal; logprobs with allclose(1e-5): the skipped prefill ran at other widths, and
the forward is not yet width-invariant (bitwise once it is). Level (a) for the block store itself: LRU eviction of
leaves only, pins, exact keys.
"""

from __future__ import annotations

import pytest
import torch

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.drafters.model import ModelDrafter
from verispec.engine import CACHE_SLACK, SpeculativeEngine
from verispec.engine.scheduler import SchedulerConfig
from verispec.runtime.caches.kv_cache import SlotCache
from verispec.runtime.caches.prefix_cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LEN = 256
SYSTEM = "You are a helpful assistant. Answer briefly and well. "


@pytest.fixture(scope="module")
def models(small_pair):
    return small_pair


@pytest.fixture(scope="module")
def shared(tokenizer):
    """Prompts that share a long system prompt (several blocks), then differ."""
    tails = ["the cat sat on the", "one two three", "Paris is the capital of", "the dog sat on the log. the",
             "a", "seven eight nine"]
    return [tokenizer(SYSTEM + tail)["input_ids"] for tail in tails]


def engines(target, tokenizer, drafter=None, draft_off=None, **kwargs):
    spec = SpeculativeConfig(num_draft_tokens=3)
    on = SpeculativeEngine(target, tokenizer, drafter, spec, max_len=MAX_LEN, **kwargs)
    off = SpeculativeEngine(target, tokenizer, draft_off, spec, max_len=MAX_LEN, enable_prefix_caching=False,
                            **kwargs)
    return on, off


def assert_same(results, expected):
    for got, want in zip(results, expected, strict=True):
        assert torch.equal(torch.tensor(got.token_ids), torch.tensor(want.token_ids))
        if want.logprobs is not None:
            assert torch.allclose(torch.tensor([t.logprob for t in got.logprobs]),
                                  torch.tensor([t.logprob for t in want.logprobs]), atol=1e-5, rtol=0)


def greedy(n=12, **kwargs):
    return SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=2, **kwargs)


def test_hit_equals_miss_greedy_one_by_one(models, tokenizer, shared):
    target, _ = models
    on, off = engines(target, tokenizer, max_batch_size=2)
    results = [on.generate(p, greedy(), use_drafter=False) for p in shared]
    expected = [off.generate(p, greedy(), use_drafter=False) for p in shared]
    assert_same(results, expected)
    cached = [r.stats.cached_tokens for r in results]
    assert cached[0] == 0 and all(c >= 16 for c in cached[1:]), cached  # the system prompt's blocks
    assert on.prefix_cache.hit_tokens == sum(cached)
    assert off.prefix_cache is None and all(r.stats.cached_tokens == 0 for r in expected)
    # The same prompt again: everything but its last block's remainder comes from the cache.
    again = on.generate(shared[0], greedy(), use_drafter=False)
    assert_same([again], expected[:1])
    assert again.stats.cached_tokens == (len(shared[0]) - 1) // 16 * 16


def test_fully_cached_prompt_joins_at_once(models, tokenizer):
    target, _ = models
    on, off = engines(target, tokenizer, max_batch_size=2)
    prompt = (tokenizer(SYSTEM * 2)["input_ids"] * 2)[:33]  # 32 tokens to prefill: two full blocks
    first = on.generate(prompt, greedy(), use_drafter=False)
    second = on.generate(prompt, greedy(), use_drafter=False)
    assert second.stats.cached_tokens == 32 and second.stats.prefill_s == 0.0  # no prefill forward at all
    assert_same([first, second], [off.generate(prompt, greedy(), use_drafter=False)] * 2)


def test_seeded_sampling_with_a_drafter(models, tokenizer, shared):
    target, draft = models
    on, off = engines(target, tokenizer, ModelDrafter(draft, MAX_LEN + CACHE_SLACK),
                      ModelDrafter(draft, MAX_LEN + CACHE_SLACK), max_batch_size=3)
    params = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=i, ignore_eos=True, logprobs=1, coupled=False)
              for i in range(len(shared))]
    results = [on.generate(p, s) for p, s in zip(shared, params)]
    expected = [off.generate(p, s) for p, s in zip(shared, params)]
    assert_same(results, expected)
    assert on.prefix_cache.hit_tokens > 0
    assert on.drafter._prefix.hit_tokens > 0  # the draft model's own prefix cache hit too
    assert off.drafter._prefix is None


def test_greedy_batch_with_a_drafter_equals_target_alone(models, tokenizer, shared):
    target, draft = models
    on, off = engines(target, tokenizer, ModelDrafter(draft, MAX_LEN + CACHE_SLACK), max_batch_size=3)
    params = [greedy(10 + 3 * (i % 3)) for i in range(len(shared))]  # rows finish at different steps
    results = on.generate_batch(shared, params)  # more prompts than slots: later ones wait and hit
    expected = off.generate_batch(shared, params, use_drafter=False)
    assert_same(results, expected)
    assert sum(r.stats.cached_tokens for r in results) > 0
    assert_same(on.generate_batch(shared, params), expected)  # all cached now, slots reused


@pytest.mark.parametrize("chunk", [16, 20])
def test_chunked_prefill(models, tokenizer, shared, chunk):
    target, _ = models
    config = SchedulerConfig(max_batched_tokens=48, prefill_chunk_tokens=chunk)
    on, off = engines(target, tokenizer, max_batch_size=3, scheduler=config)
    results = on.generate_batch(shared, greedy(), use_drafter=False)
    expected = off.generate_batch(shared, greedy(), use_drafter=False)
    assert_same(results, expected)
    assert all(r.stats.cached_tokens > 0 for r in results[1:])


class CountingTable(dict):
    """The block store's table, counting lookups of block keys (each one hashes a block's tokens)."""

    lookups = 0

    def get(self, key, default=None):
        self.lookups += 1
        return super().get(key, default)


def test_each_block_is_looked_up_once_per_admission_and_store(models, tokenizer):
    """Admission walks the prompt's blocks once (no second walk for the wait-or-match check), and storing after
    each prefill chunk goes on from the sequence's cursor instead of re-walking from the root."""
    target, _ = models
    on, off = engines(target, tokenizer, max_batch_size=2,
                      scheduler=SchedulerConfig(max_batched_tokens=64, prefill_chunk_tokens=16))
    prompt = tokenizer(SYSTEM * 3 + "the cat sat on the")["input_ids"]
    blocks = (len(prompt) - 1) // 16
    assert blocks >= 4  # several chunks: a re-walk from the root would show
    table = on.prefix_cache.table = CountingTable()
    first = on.generate(prompt, greedy(), use_drafter=False)
    assert table.lookups == 1 + blocks  # the miss at the first block, then each block stored once
    table.lookups = 0
    again = on.generate(prompt, greedy(), use_drafter=False)
    assert table.lookups == blocks and again.stats.cached_tokens == blocks * 16  # the match; nothing left to store
    assert_same([first, again], [off.generate(prompt, greedy(), use_drafter=False)] * 2)
    assert not on.prefix_cache.pins  # every chain released


def test_n_copies_share_one_prefill(models, tokenizer, shared):
    """n > 1: the copies of one prompt wait for the first one's prefill and copy its blocks."""
    target, _ = models
    on, off = engines(target, tokenizer, max_batch_size=4)
    prompt = shared[3]
    params = [SamplingParams(max_new_tokens=12, temperature=0.9, seed=5 + i, ignore_eos=True, coupled=False) for i in range(3)]
    results = on.generate_batch([prompt] * 3, params)
    assert_same(results, off.generate_batch([prompt] * 3, params))
    full = (len(prompt) - 1) // 16 * 16
    assert [r.stats.cached_tokens for r in results] == [0, full, full]


def test_eviction_under_a_small_budget(models, tokenizer, shared):
    target, _ = models
    on, off = engines(target, tokenizer, max_batch_size=2, prefix_cache_tokens=48)  # 3 blocks
    distinct = [tokenizer(f"{i} " * 20 + tail)["input_ids"] for i, tail in enumerate(["a b", "c d", "e f"])]
    order = distinct + shared[:2] + distinct[:1]
    results = [on.generate(p, greedy(), use_drafter=False) for p in order]
    assert_same(results, [off.generate(p, greedy(), use_drafter=False) for p in order])
    store = on.prefix_cache
    assert store.stored <= 3 and store.evicted > 0 and store.data.shape[0] == 3


def test_abort_while_admitted_releases_its_pins(models, tokenizer, shared):
    target, _ = models
    on, _ = engines(target, tokenizer, max_batch_size=2)
    on.generate(shared[0], greedy(), use_drafter=False)
    seq = on.add_request(shared[1], greedy())
    on.scheduler._match_prefix(on.waiting[0])  # as admission does, then the client leaves
    assert on.prefix_cache.pins
    on.abort(seq)
    assert not on.prefix_cache.pins and not on.has_unfinished


# -- the block store alone -----------------------------------------------------------------------------------------

def filled_cache(tokens: int) -> SlotCache:
    """A SlotCache of 2 layers whose slot 0 holds `tokens` entries, entry t's values all equal to t."""
    cache = SlotCache(num_layers=2, num_slots=2, max_len=64)
    entries = torch.arange(tokens, dtype=torch.float32).view(1, 1, 1, tokens, 1).expand(2, 2, 2, tokens, 4)
    cache.write_prefix(0, entries.contiguous())  # [layers, 2, kv_heads, tokens, head_dim]
    return cache


def test_store_copies_exact_entries_and_keys_whole_prefixes():
    cache = filled_cache(40)
    store = PrefixCache(cache, max_tokens=64, block_size=8)
    tokens = list(range(100, 140))
    store.insert(0, tokens)
    assert store.stored == 5
    assert len(store.match(tokens[:23])) == 2  # full blocks only
    assert store.match([0] + tokens[1:]) == []  # a different first block: nothing, though later blocks agree
    loaded = store.load(1, store.match(tokens))
    assert loaded == 40 and cache.lengths[1] == 40
    assert torch.equal(cache.read_entries(1, 0, 40), cache.read_entries(0, 0, 40))


def test_store_evicts_least_recently_used_leaves_and_never_pinned_blocks():
    cache = filled_cache(32)
    store = PrefixCache(cache, max_tokens=32, block_size=8)  # 4 blocks
    a = list(range(32))
    store.insert(0, a[:16])  # a0, a1
    store.insert(0, a[:8] + list(range(50, 58)))  # a0, b1: a0 touched last
    pinned = store.match(a[:16])  # a0, a1 pinned
    store.pin(pinned)
    store.insert(0, list(range(60, 76)))  # c0, c1: the one free block, then b1 (the LRU unpinned leaf)
    assert len(store.match(a[:16])) == 2 and len(store.match(a[:8] + list(range(50, 58)))) == 1
    assert store.evicted == 1
    store.insert(0, list(range(80, 88)))  # everything else pinned or c0's descendant? c1 is the LRU leaf
    assert len(store.match(list(range(60, 76)))) == 1 and store.evicted == 2
    store.unpin(pinned)
    assert not store.pins


def test_server_budget_shares_the_kv_bound(models):
    """--kv-cache-memory: the slots take max_len each, the prefix cache what is left; without it, as many tokens
    as the slots hold, within free memory."""
    from verispec.config import cache_len
    from verispec.server import ServerConfig
    from verispec.server.served import kv_bounded_slots, kv_slot_bytes, prefix_cache_tokens

    target, _ = models
    config = ServerConfig(model="unused", max_len=128, max_num_seqs=4)
    per_slot = kv_slot_bytes(config, target)
    bound = ServerConfig(model="unused", max_len=128, max_num_seqs=4, kv_cache_memory_gb=6.5 * per_slot / 2**30)
    slots = kv_bounded_slots(bound, target, free_bytes=2**40)
    assert slots == 4 and prefix_cache_tokens(bound, target, slots) == int(2.5 * cache_len(128))
    assert prefix_cache_tokens(config, target, 4, free_bytes=2**40) == 4 * cache_len(128)
    assert prefix_cache_tokens(config, target, 4, free_bytes=int(5 * per_slot / 0.9)) == cache_len(128)
    off = ServerConfig(model="unused", max_len=128, max_num_seqs=4, enable_prefix_caching=False)
    assert prefix_cache_tokens(off, target, 4, free_bytes=2**40) == 0


def test_a_draft_head_request_computes_its_prompt_and_stores_it(models, tokenizer, shared):
    """A draft head reads the prompt's hidden states, which the cache does not hold: its requests never start
    from cached blocks (yet store theirs), and stay exact."""
    from verispec.distill.head import HeadNet
    from verispec.drafters.head import HeadConfig, HeadDrafter

    target, _ = models
    config = HeadConfig.for_target(target.config, "tiny", target.config.vocab_size)
    head = HeadDrafter(config, HeadNet(config, target, torch.arange(target.config.vocab_size), seed=0).export(),
                       target, MAX_LEN)
    on, off = engines(target, tokenizer, max_batch_size=2)
    with_head = [on.generate(p, greedy(), drafter=head) for p in shared[:2]]
    assert [r.stats.cached_tokens for r in with_head] == [0, 0] and on.prefix_cache.stored > 0
    plain = on.generate(shared[1], greedy(), use_drafter=False)  # a request without the head hits its blocks
    assert plain.stats.cached_tokens > 0
    assert_same(with_head + [plain], [off.generate(p, greedy(), use_drafter=False) for p in shared[:2] + shared[1:2]])
