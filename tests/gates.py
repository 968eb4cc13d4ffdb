"""A gate on the engine's step loop, so that a server test never races the machine's speed.

A test that needs "the long request is still running when X happens" must not guess how long a step takes: on a
faster CPU the request finishes first, on a loaded one a timeout fires late. It holds the step loop instead:
while the gate is held the worker thread waits before its next `engine.step()`, with every earlier step fully
posted (events, gauges, metrics), so nothing the engine does can move until the test releases it.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

WAIT_S = 120  # a bound on every wait: a test that forgot to release fails instead of hanging the suite


class StepGate:
    """Wraps `engine.step` (through `monkeypatch`): `hold()` parks the worker before its next step, `release()`
    lets it run freely, `advance()` lets exactly one more step run and waits until the worker is parked again."""

    def __init__(self, monkeypatch, engine) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._permits = 0  # steps allowed through while held
        self.parked = False  # the worker waits at the gate, all earlier steps posted
        self.steps = 0  # steps that went through the gate
        step = engine.step

        def gated():
            with self._cond:
                self.parked = True
                self._cond.notify_all()
                if not self._cond.wait_for(lambda: not self._held or self._permits > 0, timeout=WAIT_S):
                    raise RuntimeError("StepGate: held for longer than the test's bound")
                self._permits -= self._held
                self.parked = False
                self.steps += 1
            return step()

        monkeypatch.setattr(engine, "step", gated)

    def hold(self) -> None:
        """No step starts after the one running now, if any."""
        with self._cond:
            self._held, self._permits = True, 0

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def wait_parked(self) -> None:
        """Until the worker waits at the (held) gate: every step before it has been posted."""
        with self._cond:
            assert self._cond.wait_for(lambda: self.parked, timeout=WAIT_S), "the worker never reached the gate"

    def advance(self) -> None:
        """Held: let one step through and wait until the worker is back at the gate (its step posted)."""
        with self._cond:
            assert self._held, "advance() needs a held gate"
            self._cond.wait_for(lambda: self.parked, timeout=WAIT_S)
            done = self.steps
            self._permits = 1
            self._cond.notify_all()
            assert self._cond.wait_for(lambda: self.steps > done and self.parked, timeout=WAIT_S), \
                "the step after the gate did not come back to it (no work left?)"

    def advance_once(self, condition) -> None:
        """Held: once `condition()` holds (polled), let one step through, as `advance`."""
        deadline = time.monotonic() + WAIT_S
        while not condition():
            assert time.monotonic() < deadline, "the condition to advance on never held"
            time.sleep(0.005)
        self.advance()

    def advance_until(self, condition, limit: int = 100) -> None:
        """Held: one step at a time until `condition()` holds (checked before each step), at most `limit` steps."""
        for _ in range(limit):
            if condition():
                return
            self.advance()
        assert condition(), f"not reached in {limit} steps"

    @contextmanager
    def held_from_start(self):
        """Held inside the block without waiting for the worker (it is idle: it takes the block's request, then
        waits before its first step), released however the block ends."""
        self.hold()
        try:
            yield self
        finally:
            self.release()


class EventReader:
    """An SSE response's `data:` lines, read on a thread, so a test can step a held engine until some arrive."""

    def __init__(self, response) -> None:
        self.events: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(response,), daemon=True)
        self._thread.start()

    def _read(self, response) -> None:
        try:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    with self._cond:
                        self.events.append(line)
                        self._cond.notify_all()
        except Exception:  # noqa: BLE001 - the test closed the response: reading simply stops
            pass

    def has(self, count: int, wait_s: float = 0.05) -> bool:
        """Whether `count` events arrived, waiting up to `wait_s` (a step's events reach the socket soon after it)."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.events) >= count, timeout=wait_s)

    def all(self) -> list[str]:
        """Every event, once the stream has ended."""
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the stream did not end"
        return self.events


class VirtualClock:
    """A clock a test drives, for code that measures its own costs (adaptive K): patch `time.perf_counter` with
    `now` and `time.sleep` with `advance`, and charge simulated work with `advance`, so the measured costs are the
    test's and not the machine's."""

    def __init__(self) -> None:
        self._t = 1000.0
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._t += max(0.0, seconds)


def virtual_costs(monkeypatch, engine, forward_s: float = 0.005, per_token_s: float = 0.0001) -> VirtualClock:
    """Costs the engine measures (adaptive K) from a clock the test drives, not from this machine's speed: each
    target forward costs `forward_s` + `per_token_s` a fed token; `time.sleep` (a drafter's simulated cost)
    advances the clock; everything else is free."""
    import time

    clock = VirtualClock()
    monkeypatch.setattr(time, "perf_counter", clock.now)
    monkeypatch.setattr(time, "sleep", clock.advance)
    forward = engine.target.forward

    def costed_forward(tokens, *args, **kwargs):
        clock.advance(forward_s + per_token_s * tokens.numel())
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(engine.target, "forward", costed_forward)
    return clock
