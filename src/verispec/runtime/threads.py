"""How many threads a step runs on: `--threads N` fixed, or `--threads auto` (the default), the cores free now.

A user's machine is never idle. Beside one busy process on 2 cores, two threads made every parallel region wait for
the thread the OS had descheduled (the work pool, kernels/pool.py, bounds that to a chunk), and still lose to one
thread on the one free core: three runnable threads on two cores leave the step's own thread off its core a third
of the time. So under `auto` the governor (`ThreadGovernor`) runs as many threads as there are free cores:

- every `WINDOW_S` at a step boundary it reads the CPUs' busy time (/proc/stat, the cores this process may run on,
  steal included) and its own CPU time; what others used is the difference, and the free cores are the cores less
  that (rounded: a process using a fifth of a core leaves it free). Work at a positive nice level (`nice` in
  /proc/stat: a background job that yields to us) counts as free, as the scheduler treats it;
- between windows, a step far slower than the recent ones of the same shape (`STRAGGLER_FACTOR` x their median,
  twice within `STRAGGLER_STEPS` steps) drops a thread at once; the next window that finds the core free restores it.

Which thread computes an output never changes its bits, so a change of threads changes only speed. `step()` is the
scope of one engine step: it applies the governor's choice, runs torch's own intra-op threads at 1 inside it where the
kernels run on the pool (torch's OpenMP workers, spinning after a torch op, took the core the pool's worker needed:
docs/runner.md, "Threads"), and times the step. `report()` says what ran (`--json`, the bench).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from verispec.runtime.kernels import pool

WINDOW_S = 0.5  # how often (at most) the free cores are measured
STRAGGLER_FACTOR = 3.0  # a step this many times its shape's recent median ...
STRAGGLER_MIN_S = 0.002  # ... and at least this long (shorter ones are timer noise) ...
STRAGGLER_STEPS = 8  # ... twice within this many steps of its shape drops a thread
HISTORY = 16  # recent step times kept per shape
AUTO = "auto"


def parse_threads(value: str | int) -> int | str:
    """`--threads`: 'auto' -> 'auto'; a positive integer -> it. ValueError naming the fix otherwise."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--threads must be 'auto' or a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"--threads must be 'auto' or a positive integer, got {n}")
    return n


def usable_cores() -> int:
    """Cores this process may run on: its affinity, capped by a cgroup CPU quota (containers)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds: busy on this process's cores (others' and ours), and this process's own."""

    wall: float
    busy: float
    own: float


def read_cpu_sample() -> CpuSample | None:
    """The cores' busy seconds from /proc/stat (user, system, irq, softirq, steal; not nice, idle or iowait) and
    this process's CPU seconds; None where /proc/stat cannot be read (not Linux)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if cores is not None and int(name[3:]) not in cores:
            continue
        user, _nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
        busy += user + system + irq + softirq + steal
    return CpuSample(time.monotonic(), busy / hz, time.process_time())


@dataclass
class ThreadsReport:
    """What ran: the setting, the threads now, why, and how often `auto` changed them."""

    setting: int | str  # N, 'auto', or 'as set' (nothing configured: the library's default)
    threads: int
    reason: str
    changes: int = 0
    by_threads: dict[int, int] = field(default_factory=dict)  # steps run on each thread count

    def as_dict(self) -> dict:
        return {"setting": self.setting, "threads": self.threads, "reason": self.reason, "changes": self.changes,
                "steps_by_threads": {str(k): v for k, v in sorted(self.by_threads.items())}}


class ThreadGovernor:
    """The threads of the process's steps (see the module docstring). One per process: `GOVERNOR`."""

    def __init__(self, setting: int | str | None = None, cores: int | None = None,
                 sample: Callable[[], CpuSample | None] = read_cpu_sample,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sample = sample
        self._clock = clock  # the clock of the samples' `wall`
        self.configure(setting, cores)

    def configure(self, setting: int | str | None = AUTO, cores: int | None = None) -> None:
        """Set `--threads`: an integer fixes it; 'auto' follows the free cores (at most `cores`, default the
        usable cores); None leaves the threads as they are (torch's / the pool's) and never changes them: a
        library caller's own `torch.set_num_threads` stands until something asks for 'auto'."""
        self.setting = None if setting is None else parse_threads(setting)
        self.cores = cores or usable_cores()
        self._window: CpuSample | None = None
        self._times: dict[tuple, deque] = defaultdict(lambda: deque(maxlen=HISTORY))
        self._strikes: dict[tuple, deque] = defaultdict(lambda: deque(maxlen=STRAGGLER_STEPS))
        self.changes = 0
        self.by_threads: dict[int, int] = defaultdict(int)
        if self.setting == AUTO:
            self.reason = f"auto: {self.cores} usable cores, none measured busy yet"
            pool.set_threads(self.cores)
        elif self.setting is None:
            self.reason = "as set (torch.set_num_threads / pool.set_threads); --threads auto adapts"
        else:
            self.reason = f"--threads {self.setting}"
            pool.set_threads(int(self.setting))

    @property
    def threads(self) -> int:
        return pool.threads()

    def _change(self, n: int, reason: str) -> None:
        if n != self.threads:
            self.changes += 1
            self._times.clear()
            self._strikes.clear()
            pool.set_threads(n)
        self.reason = reason

    def measure(self) -> None:
        """Under 'auto': at most every WINDOW_S, the free cores from the CPU time others used -> the threads."""
        if self.setting != AUTO:
            return
        last = self._window
        if last is not None and self._clock() - last.wall < WINDOW_S:
            return  # within the window: /proc/stat is read once a window, not once a step
        now = self._sample()
        if now is None:
            return
        self._window = now
        if last is None:
            return
        wall = now.wall - last.wall
        others = max(0.0, (now.busy - last.busy) - (now.own - last.own)) / wall
        free = self.cores - others
        n = max(1, min(self.cores, round(free)))
        self._change(n, f"auto: others used {others:.2f} of {self.cores} cores over {wall:.1f} s")

    def observe(self, key: tuple, seconds: float) -> None:
        """A step of shape `key` took `seconds`: under 'auto', a straggler (twice within STRAGGLER_STEPS of its
        shape, STRAGGLER_FACTOR x the recent median) drops a thread at once."""
        threads = self.threads
        self.by_threads[threads] += 1
        if self.setting != AUTO:
            return
        times, strikes = self._times[key], self._strikes[key]
        slow = (len(times) >= HISTORY // 2 and seconds >= STRAGGLER_MIN_S
                and seconds > STRAGGLER_FACTOR * statistics.median(times))
        strikes.append(slow)
        times.append(seconds)
        if slow and sum(strikes) >= 2 and threads > 1:
            self._change(threads - 1, f"auto: steps of shape {key} took {STRAGGLER_FACTOR:g}x their median "
                         "(a thread waiting on a busy core)")

    @contextmanager
    def step(self) -> Iterator[dict]:
        """One engine step: the threads chosen, torch's intra-op threads at 1 inside where the kernels run on the
        pool, the step timed. The caller sets `scope["key"]` (the step's shape) to have it judged as a straggler."""
        if self.setting is None:  # nothing configured: the pool follows torch's threads, as the caller set them
            pool.set_threads(torch.get_num_threads())
        self.measure()
        pooled, torch_threads = pool.kernel() is not None, torch.get_num_threads()
        if pooled:
            torch.set_num_threads(1)
        scope: dict = {}
        start = time.perf_counter()
        try:
            yield scope
        finally:
            if pooled:
                torch.set_num_threads(torch_threads)
            if "key" in scope:
                self.observe(scope["key"], time.perf_counter() - start)

    def reset_counts(self) -> None:
        """Start counting steps and changes afresh (a bench run's own figures)."""
        self.changes = 0
        self.by_threads = defaultdict(int)

    def report(self) -> ThreadsReport:
        return ThreadsReport(self.setting or "as set", self.threads, self.reason, self.changes, dict(self.by_threads))


_GOVERNOR: list[ThreadGovernor] = []  # the process's, made on first use


def governor() -> ThreadGovernor:
    """The process's governor: it leaves the threads as they are until `configure_threads` (the CLI's and the
    server's `--threads`, 'auto' by default) says otherwise."""
    if not _GOVERNOR:
        _GOVERNOR.append(ThreadGovernor())
    return _GOVERNOR[0]


def configure_threads(setting: int | str | None) -> ThreadGovernor:
    """`--threads N|auto` for the process (CLI, server, bench, API)."""
    g = governor()
    g.configure(setting)
    return g
