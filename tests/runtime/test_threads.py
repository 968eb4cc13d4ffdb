"""`--threads N|auto` (runtime/threads.py): the governor's choices from the CPU time others used and from straggling
steps, on a fake clock and a fake pool (nothing here depends on the machine)."""

from __future__ import annotations

import pytest

from verispec.runtime import threads as threads_mod
from verispec.runtime.threads import WINDOW_S, CpuSample, ThreadGovernor, parse_threads

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


class FakeCpu:
    """/proc/stat and process_time as a test drives them: `advance(wall, others, own)` in core-seconds."""

    def __init__(self) -> None:
        self.now = CpuSample(0.0, 0.0, 0.0)

    def advance(self, wall: float, others: float, own: float) -> None:
        n = self.now
        self.now = CpuSample(n.wall + wall, n.busy + others + own, n.own + own)

    def __call__(self) -> CpuSample:
        return self.now


@pytest.fixture
def fake_pool(monkeypatch):
    state = {"threads": 2}
    monkeypatch.setattr(threads_mod.pool, "set_threads", lambda n: state.__setitem__("threads", n))
    monkeypatch.setattr(threads_mod.pool, "threads", lambda: state["threads"])
    monkeypatch.setattr(threads_mod.pool, "kernel", lambda: None)
    return state


def auto(cpu: FakeCpu, cores: int = 2) -> ThreadGovernor:
    g = ThreadGovernor("auto", cores=cores, sample=cpu, clock=lambda: cpu.now.wall)
    g.measure()  # the first window starts
    return g


def test_parse_threads():
    assert parse_threads("auto") == "auto" and parse_threads("AUTO") == "auto"
    assert parse_threads("3") == 3 and parse_threads(2) == 2
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="'auto' or a positive integer"):
            parse_threads(bad)


def test_auto_uses_the_cores_others_leave_free(fake_pool):
    cpu = FakeCpu()
    g = auto(cpu)
    assert fake_pool["threads"] == 2
    cpu.advance(WINDOW_S, others=0.7 * WINDOW_S, own=1.3 * WINDOW_S)  # a busy process squeezed beside two threads
    g.measure()
    assert fake_pool["threads"] == 1 and "others used 0.70" in g.reason
    cpu.advance(WINDOW_S, others=1.0 * WINDOW_S, own=1.0 * WINDOW_S)  # it keeps its core
    g.measure()
    assert fake_pool["threads"] == 1
    cpu.advance(WINDOW_S, others=0.1 * WINDOW_S, own=1.0 * WINDOW_S)  # it stopped: the core is free again
    g.measure()
    assert fake_pool["threads"] == 2
    assert g.report().changes == 2


def test_a_window_is_measured_only_when_it_is_long_enough(fake_pool):
    cpu = FakeCpu()
    g = auto(cpu)
    cpu.advance(WINDOW_S / 4, others=WINDOW_S / 4, own=WINDOW_S / 4)
    g.measure()
    assert fake_pool["threads"] == 2  # too short to judge
    cpu.advance(WINDOW_S, others=WINDOW_S, own=WINDOW_S)
    g.measure()
    assert fake_pool["threads"] == 1


def test_stragglers_drop_a_thread_and_one_slow_step_does_not(fake_pool):
    g = auto(FakeCpu())
    for _ in range(16):
        g.observe((1, 5), 0.005)
    g.observe((1, 5), 0.05)  # one slow step: noise
    assert fake_pool["threads"] == 2
    g.observe((1, 5), 0.005)
    g.observe((1, 5), 0.05)  # the second within STRAGGLER_STEPS: a thread waits on a busy core
    assert fake_pool["threads"] == 1 and "median" in g.reason
    g.observe((4, 20), 0.05)  # another shape has no history: not judged
    assert fake_pool["threads"] == 1


def test_a_fixed_setting_never_changes(fake_pool):
    cpu = FakeCpu()
    g = ThreadGovernor(2, cores=2, sample=cpu)
    g.measure()
    cpu.advance(WINDOW_S, others=2 * WINDOW_S, own=WINDOW_S)
    g.measure()
    for _ in range(20):
        g.observe((1, 1), 0.005)
    g.observe((1, 1), 1.0)
    g.observe((1, 1), 1.0)
    assert fake_pool["threads"] == 2 and g.report().changes == 0 and g.report().setting == 2


def test_unconfigured_follows_the_threads_the_caller_set(fake_pool, monkeypatch):
    set_to = {"n": 1}
    monkeypatch.setattr(threads_mod.torch, "get_num_threads", lambda: set_to["n"])
    g = ThreadGovernor(None, cores=2, sample=FakeCpu())
    with g.step():
        pass
    assert fake_pool["threads"] == 1
    set_to["n"] = 3
    with g.step() as scope:
        scope["key"] = (1, 1)
    assert fake_pool["threads"] == 3
    assert g.report().setting == "as set" and g.report().by_threads == {3: 1}
