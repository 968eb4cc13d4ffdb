"""The kernels' work pool (pool.cpp): one per process, shared by every C++ kernel through `parallel.h`.

A parallel region's items go out in small chunks to whichever thread asks first and the caller waits only for the
chunks, never for a thread to arrive, so a thread the OS has descheduled on a busy machine costs a step at most one
chunk (OpenMP's static halves and end barrier made every region wait a time slice for it: issue 40). Which thread
computes an output never changes its bits. `ext.build` hands each kernel the pool as it loads (`attach_pool`); where the
pool does not build, or under the test override VERISPEC_POOL=off (for side-by-side timings; runtime/overrides.py), the kernels keep at::parallel_for
(OpenMP). `set_threads` is how anything changes the threads a step runs on: the pool's and torch's (torch's own
ops) together.

Waiting: an idle thread spins `spin_us` microseconds (VERISPEC_POOL_SPIN_US; pool.cpp's default), then sleeps on a
futex until the next region; a region is cut into a few chunks per thread (VERISPEC_POOL_CHUNKS); docs/runner.md
("Threads") has the measurements behind the defaults. The pool starts with torch's thread count.
"""

from __future__ import annotations

import torch

from .ext import POOL_ENV, attach_pool, pool_enabled, pool_module

__all__ = ["POOL_ENV", "attach_pool", "pool_enabled", "kernel", "set_threads", "threads", "counters"]

SPIN_ENV = "VERISPEC_POOL_SPIN_US"  # measurement overrides read by pool.cpp when the pool starts (overrides.py)
CHUNKS_ENV = "VERISPEC_POOL_CHUNKS"


def kernel():
    """The pool extension, built on first use; None where it does not build or is switched off."""
    return pool_module()


def set_threads(n: int) -> None:
    """Run parallel regions on `n` threads (the caller included): the pool's and torch's intra-op threads."""
    if n < 1:
        raise ValueError(f"threads must be at least 1, got {n}")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    pool = kernel()
    if pool is not None and pool.threads() != n:
        pool.set_threads(n)


def threads() -> int:
    """Threads a parallel region runs on now."""
    pool = kernel()
    return pool.threads() if pool is not None else torch.get_num_threads()


def counters() -> dict[str, int]:
    """The pool's counters (regions shared, chunks the caller ran, times the caller slept, workers); {} without it."""
    pool = kernel()
    if pool is None:
        return {}
    return dict(zip(("regions", "caller_chunks", "caller_sleeps", "workers"), pool.counters()))
