"""The server's prefill chunk chosen from measured costs (engine/budget.py): the pure choice on hand-written costs,
the probe on a runner whose forwards cost virtual time (a clock the test drives: nothing here depends on how fast
the machine is). The served model's side: tests/server/test_server_prefill_budget.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit

from verispec.engine import budget as budget_module
from verispec.engine.budget import budget_from_costs, choose_chunk_tokens, probe_chunk_costs


def test_the_widest_chunk_within_the_bound():
    costs = {16: 0.030, 32: 0.050, 64: 0.090, 128: 0.170}  # seconds of a chunk's forward
    assert choose_chunk_tokens(costs, decode_s=0.040, decode_steps=2.0) == 32  # 0.050 <= 0.080 < 0.090
    assert choose_chunk_tokens(costs, decode_s=0.040, decode_steps=4.0) == 64  # 0.170 > 0.160
    assert choose_chunk_tokens(costs, decode_s=0.040, decode_steps=5.0) == 128
    assert choose_chunk_tokens(costs, decode_s=0.040, decode_steps=1.0) == 16  # 0.030 <= 0.040
    # the narrowest over the bound: it cannot hold, so as wide as FALLBACK_STEPS (8) decode steps allow
    assert choose_chunk_tokens(costs, decode_s=0.010, decode_steps=1.0) == 32  # 0.050 <= 0.080 < 0.090
    # none within that either: the narrowest, never nothing (a prompt must make progress)
    assert choose_chunk_tokens(costs, decode_s=0.001, decode_steps=1.0) == 16
    with pytest.raises(ValueError, match="at least one"):
        choose_chunk_tokens({}, 0.04)
    with pytest.raises(ValueError, match="decode_steps"):
        choose_chunk_tokens(costs, 0.04, decode_steps=0)


def test_budget_is_one_chunk_a_step_at_least_the_rows():
    budget = budget_from_costs({16: 0.03, 32: 0.05, 64: 0.09}, decode_s=0.04, max_num_seqs=4, decode_steps=2.0)
    assert (budget.chunk_tokens, budget.max_batched_tokens) == (32, 32)
    assert budget_from_costs({16: 0.03}, 0.04, max_num_seqs=24).max_batched_tokens == 24
    assert "32 tokens" in budget.describe() and "2 decode steps" in budget.describe()
    slow = budget_from_costs({16: 0.09, 32: 0.2}, decode_s=0.03, max_num_seqs=4, decode_steps=2.0)
    assert slow.chunk_tokens == 32 and slow.decode_steps == 8.0 and "8 decode steps" in slow.describe()


class VirtualRunner:
    """A runner whose forward of n tokens costs 10 + n virtual ms, counted on the test's clock."""

    device = torch.device("cpu")

    def __init__(self, clock: list[float]) -> None:
        self.clock, self.widths, self.length = clock, [], 0

    def forward(self, tokens, start_slot=0, last_only=False):
        n = tokens.shape[1]
        self.widths.append(n)
        self.length += n
        self.clock[0] += (10 + n) / 1e3

    def truncate(self, length, slot=0):
        self.length = min(self.length, length)

    def reset(self, slot=None):
        self.length = 0


def test_probe_measures_ascending_and_stops_past_the_bound(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: clock[0])
    runner = VirtualRunner(clock)
    decode_s, chunk_s = probe_chunk_costs(runner, decode_steps=2.0, widths=(16, 32, 64, 128), repeats=2)
    assert decode_s == pytest.approx(0.011)
    # the narrowest chunk (26 ms) is already past 2 x 11 ms: the fallback bound (8 x 11 = 88 ms) applies, and the
    # probe goes on to the first width past it (128: 138 ms)
    assert chunk_s == pytest.approx({16: 0.026, 32: 0.042, 64: 0.074, 128: 0.138})
    assert choose_chunk_tokens(chunk_s, decode_s, 2.0) == 64
    assert runner.length == 0  # the slot emptied after
    decode_s, chunk_s = probe_chunk_costs(VirtualRunner(clock), decode_steps=5.0, widths=(16, 32, 64, 128), repeats=2)
    assert list(chunk_s) == [16, 32, 64]  # 26, 42 <= 55 ms; 74 > 55: measured, then the probe stops
    assert choose_chunk_tokens(chunk_s, decode_s, 5.0) == 32
