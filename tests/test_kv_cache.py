"""Rollback is bookkeeping: truncating the pointer cache and re-feeding equals a fresh forward, with no copy."""

import torch

from conftest import BUILDERS
from verispec.runner import ModelRunner

import pytest


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_truncate_then_refeed_matches_fresh_forward(arch):
    model = BUILDERS[arch](0)
    ids = torch.randint(5, 60, (1, 12))
    fresh = ModelRunner(model, max_len=64).forward(ids)  # [1, 12, vocab]

    runner = ModelRunner(model, max_len=64)
    runner.forward(ids[:, :8])
    keys = runner.cache.layers[0].keys
    pointer = keys.data_ptr()
    runner.forward(torch.randint(5, 60, (1, 4)))  # a rejected draft
    runner.truncate(8)
    assert runner.length == 8
    out = runner.forward(ids[:, 8:])
    torch.testing.assert_close(out, fresh[:, 8:], rtol=1e-5, atol=1e-5)
    assert runner.cache.layers[0].keys.data_ptr() == pointer  # same buffer: nothing was copied or reallocated


def test_truncate_cannot_grow():
    runner = ModelRunner(BUILDERS["llama"](0), max_len=16)
    runner.forward(torch.tensor([[5, 6, 7]]))
    with pytest.raises(AssertionError):
        runner.truncate(4)


def test_forward_past_capacity_is_a_clear_error():
    runner = ModelRunner(BUILDERS["llama"](0), max_len=4)
    with pytest.raises(ValueError, match="max_len"):
        runner.forward(torch.tensor([[5, 6, 7, 8, 9]]))
