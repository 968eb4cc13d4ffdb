"""Gemma 3's sliding-window layers on rings (runtime/caches/kv_cache.py, `NativeRunner.ring`): the same logits as the
unbounded cache (every entry kept) on a tiny Gemma whose window is 8 and ring 16 (the slack patched from
MAX_VERIFY_WIDTH to 8), far past the ring: a prefill in pieces, decode steps, verify chains rolled back after
rejections, token trees (`keep_path`), slot moves in a batch, the layers looped in C++ and in Python; bitwise until
a ring wraps, within 1e-5 after (the attention then sums the window in ring order); greedy speculation equals the target alone with a prompt past the
ring; prefix caching is off on rings (said in the log) and changes no token; a ring one entry short of the window
(negative control) must differ; Llama models keep every entry."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from conftest import VOCAB, tiny_llama
from test_gemma import tiny_gemma
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.engine import SpeculativeEngine
from verispec.runtime.kernels import layer_loop
from verispec.runtime.runners import native, select
from verispec.runtime.runners.native import NativeRunner

WINDOW, SLACK = 8, 8
ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def small_rings(monkeypatch):
    """Rings of window + 8 entries (pieces of 8 tokens): they wrap within a few steps."""
    monkeypatch.setattr(native, "MAX_VERIFY_WIDTH", SLACK)


def runners(model, monkeypatch, slots: int = 3, max_len: int = 128) -> tuple[NativeRunner, NativeRunner]:
    """(every entry kept, rings) on one model."""
    full = NativeRunner.from_hf(model, max_len, slots, batch_invariant=True, sliding_ring=False)
    ring = NativeRunner.from_hf(model, max_len, slots, batch_invariant=True, sliding_ring=True)
    return full, ring


def script(runner: NativeRunner) -> list[torch.Tensor]:
    """Ragged prefills (one forward each, past the ring), verify chains rolled back, a token tree with its accepted
    path kept, a slot move, decode steps -> every forward's logits."""
    g = torch.Generator().manual_seed(0)
    out = []

    def forward(tokens, **kwargs):
        out.append(runner.forward(tokens, **kwargs).logits)
        return out[-1]

    runner.reset()
    for slot, n in enumerate((30, 13, 21)):
        forward(torch.randint(0, VOCAB, (1, n), generator=g), start_slot=slot)
    for _ in range(8):  # verify passes of 1 + 4 drafts, then each row keeps 1..5 (a rejection rolls back)
        lengths = list(runner.lengths[:3])
        forward(torch.randint(0, VOCAB, (3, 5), generator=g))
        for slot, keep in enumerate(torch.randint(1, 6, (3,), generator=g).tolist()):
            runner.truncate(lengths[slot] + keep, slot)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 0, 0, 1]],
                        dtype=torch.bool)
    for path in ([0, 2, 3], [0, 1, 4], [0]):
        lengths = torch.tensor(runner.lengths[:3])
        forward(torch.randint(0, VOCAB, (3, 5), generator=g), tree_mask=tree.expand(3, 5, 5),
                positions=lengths.view(3, 1) + torch.tensor([0, 1, 1, 2, 2]))
        for slot in range(3):
            runner.keep_path(slot, int(lengths[slot]), path)
    runner.move_slot(2, 0)  # slot 0's sequence finished: the last one moves into its slot
    for _ in range(12):
        forward(torch.randint(0, VOCAB, (2, 1), generator=g))
    return out


@pytest.mark.parametrize("loop", ["cpp", "python"])
def test_rings_give_the_unbounded_caches_logits(loop, small_rings, monkeypatch):
    monkeypatch.setattr(layer_loop, "ENABLED", loop == "cpp")
    full, ring = runners(tiny_gemma(3, window=WINDOW), monkeypatch)
    assert ring.ring == WINDOW + SLACK and full.ring is None
    assert [layer.capacity for layer in ring.cache.layers] == [16, 128, 16, 128]  # sliding, global, ...
    expect, got = script(full), script(ring)
    assert torch.equal(expect[1], got[1])  # 13 tokens: the ring has not wrapped (the same order, the same bits)
    for a, b in zip(expect, got):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)


def test_the_check_fails_with_a_ring_shorter_than_the_window(small_rings, monkeypatch):
    """Negative control: window - 1 entries (pieces of one token) lose each query's oldest visible entry."""
    model = tiny_gemma(3, window=WINDOW)
    full, _ = runners(model, monkeypatch)
    monkeypatch.setattr(native, "ring_entries", lambda spec, max_len, sliding_ring: WINDOW - 1)
    short = NativeRunner.from_hf(model, 128, 3, batch_invariant=True)
    expect, got = script(full), script(short)
    assert max((a - b).abs().max().item() for a, b in zip(expect, got)) > 100 * ATOL


def test_the_default_ring_past_its_end(monkeypatch):
    """The real slack (MAX_VERIFY_WIDTH): a 150-token prompt in one forward (pieces), then decode steps."""
    full, ring = runners(tiny_gemma(4, window=WINDOW), monkeypatch, slots=1, max_len=256)
    assert ring.ring == WINDOW + native.MAX_VERIFY_WIDTH
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (1, 150), generator=g)
    torch.testing.assert_close(ring.forward(prompt).logits, full.forward(prompt).logits, atol=ATOL, rtol=0)
    for _ in range(4):
        token = torch.randint(0, VOCAB, (1, 1), generator=g)
        torch.testing.assert_close(ring.forward(token).logits, full.forward(token).logits, atol=ATOL, rtol=0)


def test_greedy_speculation_equals_the_target_alone_past_the_ring(small_rings, monkeypatch, tokenizer, caplog):
    """Prompts of 40 and 27 tokens (ring 16), each twice, in a batch of two (slots move as rows finish); the target
    drafting for itself and a smaller Gemma drafting; prefix caching asked for but off on rings (logged): no hit, and
    the target alone gives the unbounded cache's tokens (where the second copies hit the prefix cache)."""
    from verispec.drafters.model import ModelDrafter

    target = tiny_gemma(5, window=WINDOW)
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 27)]

    def run(ring: bool, drafter: ModelDrafter, speculative: bool = True) -> list[list[int]]:
        engine = SpeculativeEngine(target, tokenizer, drafter, SpeculativeConfig(num_draft_tokens=4), 128,
                                   max_batch_size=2, enable_prefix_caching=True,
                                   runner=replace(select.DEFAULT_OPTIONS, sliding_ring=ring))
        assert engine.target.backend == "native" and (engine.target.ring is not None) == ring
        assert (engine.prefix_cache.capacity == 0) == ring
        results = engine.generate_batch(prompts + prompts, SamplingParams(max_new_tokens=30, ignore_eos=True),
                                        use_drafter=speculative)
        assert engine.prefix_cache.hit_tokens == 0 or not ring
        return [r.token_ids for r in results]

    with caplog.at_level(logging.INFO, logger="verispec"):
        alone = run(True, ModelDrafter(target, 128), speculative=False)
    assert "prefix caching off" in caplog.text
    assert alone == run(False, ModelDrafter(target, 128), speculative=False)
    assert run(True, ModelDrafter(target, 128)) == alone
    assert run(True, ModelDrafter(tiny_gemma(6, hidden=32, layers=2, window=WINDOW), 128)) == alone


def test_llama_models_keep_every_entry():
    runner = NativeRunner.from_hf(tiny_llama(3), 256)
    assert runner.ring is None and not runner.cache.has_rings
