"""The slot KV cache and the runner: rollback is bookkeeping, rows of different lengths advance together, and the
4D mask hides every stale entry. Hand-built mask cases, then equality with fresh forwards on three architectures."""

import pytest
import torch

from conftest import BUILDERS
from verispec.runtime.caches.kv_cache import attention_mask
from verispec.runtime.runners.select import HFRunner


def allowed(mask):
    return (mask == 0)[:, 0]  # [batch, n, kv_len] bool


def test_mask_causal_with_per_row_prefixes():
    # row 0 keeps 2 entries, row 1 keeps 0; 3 tokens fed each; kv_len = 5 (the longest row after the forward)
    got = allowed(attention_mask(torch.tensor([2, 0]), 3, 5, torch.float32))
    row0 = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    row1 = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]  # entries 3, 4 are stale for row 1: hidden
    assert got.tolist() == [[[bool(x) for x in r] for r in row0], [[bool(x) for x in r] for r in row1]]


def test_mask_with_a_tree():
    # fed tokens: root r, two children a, b of r (a sees r; b sees r, not a)
    tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    got = allowed(attention_mask(torch.tensor([1]), 3, 4, torch.float32, tree))[0]
    assert got.tolist() == [[True, True, False, False], [True, True, True, False], [True, True, False, True]]


def test_mask_with_a_tree_grown_over_two_forwards():
    # 1 kept entry; an earlier forward wrote children a, b (cache indices 1, 2); now a's child c and b's child d
    # are fed (indices 3, 4): c sees a, not b; d sees b, not a (m = 4 columns: the 2 earlier entries and the 2 fed)
    tree = torch.tensor([[[1, 0, 1, 0], [0, 1, 0, 1]]], dtype=torch.bool)
    got = allowed(attention_mask(torch.tensor([3]), 2, 5, torch.float32, tree))[0]
    assert got.tolist() == [[True, True, False, True, False], [True, False, True, False, True]]


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_truncate_then_refeed_matches_fresh_forward(arch):
    model = BUILDERS[arch](0)
    ids = torch.randint(5, 60, (1, 12))
    fresh = model(ids).logits  # [1, 12, vocab]
    runner = HFRunner(model, max_len=64)
    runner.forward(ids[:, :8])
    keys = runner.cache.layers[0].keys
    pointer = keys.data_ptr()
    runner.forward(torch.randint(5, 60, (1, 4)))  # a rejected draft
    runner.truncate(8)
    assert runner.length == 8
    out = runner.forward(ids[:, 8:]).logits
    torch.testing.assert_close(out, fresh[:, 8:], rtol=1e-5, atol=1e-5)
    assert runner.cache.layers[0].keys.data_ptr() == pointer  # same buffer: nothing was copied or reallocated


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_ragged_rows_advance_together(arch):
    """Two sequences of different lengths in two slots, fed together with different numbers of real tokens
    (padding), rolled back to different lengths and fed again: every row equals its fresh forward."""
    model = BUILDERS[arch](0)
    a, c = torch.randint(5, 60, (1, 12)), torch.randint(5, 60, (1, 7))
    fresh_a, fresh_c = model(a).logits[0], model(c).logits[0]
    runner = HFRunner(model, max_len=64, num_slots=2)
    runner.forward(a[:, :8], start_slot=0)  # prefill each slot alone
    runner.forward(c[:, :2], start_slot=1)
    fed = torch.stack([a[0, 8:12], torch.cat([c[0, 2:4], torch.tensor([0, 0])])])  # row 1: 2 real + 2 padding
    out = runner.forward(fed, want_hidden=True)
    torch.testing.assert_close(out.logits[0], fresh_a[8:12], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits[1, :2], fresh_c[2:4], rtol=1e-5, atol=1e-5)
    assert out.hidden.shape == (2, 4, model.config.get_text_config().hidden_size)
    runner.truncate(10, 0)  # row 0 rejects 2 tokens; row 1 keeps its 2 real ones and drops the padding
    runner.truncate(4, 1)
    out = runner.forward(torch.stack([a[0, 10:12], c[0, 4:6]]), logits_at=torch.tensor([[1], [0]]))
    torch.testing.assert_close(out.logits[0, 0], fresh_a[11], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits[1, 0], fresh_c[4], rtol=1e-5, atol=1e-5)


def test_move_slot_keeps_the_sequence():
    model = BUILDERS["llama"](0)
    ids = torch.randint(5, 60, (1, 9))
    fresh = model(ids).logits[0]
    runner = HFRunner(model, max_len=32, num_slots=3)
    runner.forward(torch.randint(5, 60, (3, 1)))
    runner.truncate(0, 2)
    runner.forward(ids[:, :6], start_slot=2)
    runner.move_slot(2, 0)  # compaction: slot 2's sequence now lives in slot 0
    assert runner.lengths[0] == 6 and runner.lengths[2] == 0
    out = runner.forward(ids[:, 6:], start_slot=0)
    torch.testing.assert_close(out.logits[0], fresh[6:], rtol=1e-5, atol=1e-5)


def test_truncate_cannot_grow():
    runner = HFRunner(BUILDERS["llama"](0), max_len=16)
    runner.forward(torch.tensor([[5, 6, 7]]))
    with pytest.raises(AssertionError):
        runner.truncate(4)


def test_forward_past_capacity_is_a_clear_error():
    runner = HFRunner(BUILDERS["llama"](0), max_len=4)
    with pytest.raises(ValueError, match="max_len"):
        runner.forward(torch.tensor([[5, 6, 7, 8, 9]]))
