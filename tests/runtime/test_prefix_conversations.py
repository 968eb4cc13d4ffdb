"""The prefix cache's eviction policy for conversations (runtime/caches/prefix_cache.py, "Conversations"): a chain
released as a conversation's turn outlives more recent one-off prompts for protect_s seconds (a clock the test
drives), then is plain LRU again; protection never refuses a store; the scheduler protects a turn that found most
of its prompt cached, and not a one-off prompt. Each case has its plain-LRU negative control."""

from __future__ import annotations

import pytest
import torch

from verispec.runtime.caches.kv_cache import SlotCache
from verispec.runtime.caches.prefix_cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def store_of(clock: Clock, blocks: int = 4) -> PrefixCache:
    cache = SlotCache(num_layers=2, num_slots=2, max_len=64)
    entries = torch.zeros(2, 2, 2, 32, 4)  # [layers, 2, kv_heads, tokens, head_dim]
    cache.write_prefix(0, entries)
    return PrefixCache(cache, max_tokens=8 * blocks, block_size=8, protect_s=300.0, clock=clock)


def put(store: PrefixCache, tokens: list[int], protect: bool) -> None:
    chain: list[int] = []
    store.extend(0, tokens, chain)
    store.release(chain, protect=protect)


FILE, ONE_OFF, OTHER = list(range(16)), list(range(100, 116)), list(range(200, 216))


@pytest.mark.parametrize("protect", [True, False])
def test_a_conversation_outlives_more_recent_one_off_prompts(protect):
    clock = Clock()
    store = store_of(clock)
    put(store, FILE, protect)  # a conversation's file (2 blocks)
    clock.now = 10.0
    put(store, ONE_OFF, False)  # a one-off prompt, more recent
    put(store, OTHER, False)  # needs 2 blocks: someone is evicted
    kept = len(store.match(FILE, count=False))
    if protect:
        assert kept == 2 and store.match(ONE_OFF, count=False) == [] and store.evicted_protected == 0
    else:  # negative control: plain LRU takes the file, the least recently used
        assert kept == 0 and len(store.match(ONE_OFF, count=False)) == 2


def test_protection_ends_and_never_refuses_a_store():
    clock = Clock()
    store = store_of(clock)
    put(store, FILE, True)
    put(store, ONE_OFF, True)
    clock.now = 100.0
    put(store, OTHER, False)  # everything unpinned is protected: the least recently used protected goes
    assert store.match(FILE, count=False) == [] and len(store.match(OTHER, count=False)) == 2
    assert store.evicted_protected == 2
    clock.now = 100.0 + 301.0  # ONE_OFF's protection (from t = 0) is over: plain LRU again
    put(store, FILE, False)
    assert store.match(ONE_OFF, count=False) == [] and len(store.match(OTHER, count=False)) == 2
    assert store.evicted_protected == 2


def test_the_scheduler_protects_a_turn_not_a_one_off(small_pair, tokenizer):
    from verispec.config import SamplingParams, SpeculativeConfig
    from verispec.engine import SpeculativeEngine

    target, _ = small_pair
    engine = SpeculativeEngine(target, tokenizer, None, SpeculativeConfig(num_draft_tokens=3), max_len=256)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    file = tokenizer("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 2)["input_ids"]
    engine.generate(file + tokenizer(" explain it")["input_ids"], params)
    assert not engine.prefix_cache.protected  # turn 1: nothing says it will come back
    engine.generate(tokenizer("a one-off question about something else")["input_ids"], params)
    assert not engine.prefix_cache.protected  # negative control: nothing of it was cached
    engine.generate(file + tokenizer(" add docstrings")["input_ids"], params)
    protected = set(engine.prefix_cache.protected)
    assert protected and set(engine.prefix_cache.match(file[:-1], count=False)) <= protected  # the file's blocks
