"""Large, long-lived CPU buffers (the KV caches, the packed weights) on 2 MiB transparent huge pages.

A decode step streams every row's keys and values and every weight once, in short runs per (row, KV head) and per
layer: on 4 KiB pages that is a TLB miss every 4 KiB, and the hardware prefetchers stop at each page boundary.
Linux backs a 2 MiB-aligned range of anonymous memory with one huge page where the range is advised
(`madvise(MADV_HUGEPAGE)`, which the common `enabled = madvise` setting requires) before it is touched, or
collapsed into one afterwards (`MADV_COLLAPSE`, Linux 6.1+). torch's CPU allocator aligns to 64 bytes and advises
nothing (unless THP_MEM_ALLOC_ENABLE=1 is set before torch is imported, which also hands every transient
activation over 2 MiB a freshly zeroed huge page). So these buffers are cut 2 MiB-aligned out of a slightly
larger allocation and advised before they are first written; whatever the kernel refuses (THP off, no free huge
page, another OS) leaves ordinary pages: the same values, only slower. Measured in docs/runner.md ("Huge pages").
`RunnerOptions.huge_pages` (`--no-huge-pages`) turns it off for the process (`configure`).
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE = 2 << 20  # bytes in a huge page (x86-64, arm64 with 4 KiB base pages)
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
ENABLED = sys.platform.startswith("linux")  # `configure` sets it: a process's buffers are placed one way


def configure(on: bool) -> None:
    """Whether this process's large buffers go on huge pages from now on (`RunnerOptions.huge_pages`; Linux only)."""
    global ENABLED
    ENABLED = on and sys.platform.startswith("linux")

_LIBC: list = []


def _madvise(address: int, length: int, advice: int) -> bool:
    """madvise(2) on [address, address + length) (both multiples of the page size); -> whether it succeeded."""
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _LIBC.append(libc)
        except (OSError, AttributeError):
            _LIBC.append(None)
    return _LIBC[0] is not None and _LIBC[0].madvise(address, length, advice) == 0


def wanted(nbytes: int, device: torch.device | str = "cpu") -> bool:
    """Whether a buffer of nbytes on device is worth huge pages (CPU, at least one whole huge page)."""
    return ENABLED and torch.device(device).type == "cpu" and nbytes >= HUGE


def empty(shape, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.empty(shape), on huge pages where wanted (the memory is advised, not yet touched)."""
    shape = tuple(shape)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if not wanted(nbytes, device):
        return torch.empty(shape, dtype=dtype, device=device)
    padded = (nbytes + HUGE - 1) // HUGE * HUGE
    raw = torch.empty(padded + HUGE, dtype=torch.uint8)  # usually a fresh mapping at this size: untouched
    start = (-raw.data_ptr()) % HUGE
    _madvise(raw.data_ptr() + start, padded, MADV_HUGEPAGE)
    # 2 MiB-aligned, in whole huge pages; a view of raw's storage, which keeps it alive
    return raw[start : start + nbytes].view(dtype).view(shape)


def settle(t: torch.Tensor) -> torch.Tensor:
    """t (an `empty` or `arena` buffer, now written) collapsed into huge pages where its memory was touched before
    the advice (the allocator reused heap memory): MADV_COLLAPSE, best effort. -> t"""
    if wanted(t.nbytes, t.device) and t.data_ptr() % HUGE == 0:
        _madvise(t.data_ptr(), (t.nbytes + HUGE - 1) // HUGE * HUGE, MADV_COLLAPSE)
    return t


def zeros(shape, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape), on huge pages where wanted."""
    return settle(empty(shape, dtype, device).zero_())


def like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t on huge pages where wanted (else t itself, when already contiguous)."""
    if not wanted(t.nbytes, t.device):
        return t.contiguous()
    return settle(empty(t.shape, t.dtype, t.device).copy_(t))


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes of t's memory on huge pages, as far as /proc/self/smaps tells (Linux; 0 elsewhere): the AnonHugePages
    of each mapping t overlaps, capped at the overlap. smaps counts per mapping, so where t shares one with other
    memory this is an upper bound. For tests and probes."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return 0
    lo, hi = t.data_ptr(), t.data_ptr() + t.nbytes
    total, inside = 0, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                start, end = (int(x, 16) for x in head[0].split("-"))
                inside = (start, end) if start < hi and end > lo else None
            elif inside is not None and head[0] == "AnonHugePages:":
                start, end = inside
                total += min(int(head[1]) * 1024, min(end, hi) - max(start, lo))
    return total


def arena(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """One arena on huge pages for `tensors` (on the CPU, together at least a huge page) -> (the arena, an empty view
    per tensor with its shape and dtype, cut in order, each on a 64-byte boundary); None where it is not wanted (too
    small, not on the CPU, turned off). The caller fills the views (`copy_`) and can drop each original as it goes,
    so memory peaks at the arena plus what is not moved yet, then calls `settle(arena)`."""
    if any(t.device.type != "cpu" for t in tensors):
        return None
    return arena_for([(t.shape, t.dtype) for t in tensors])


def arena_for(specs: list[tuple[torch.Size, torch.dtype]]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """`arena` for tensors not made yet, by (shape, dtype): the caller fills each view as it makes its tensor (so
    the tensors never all exist beside the arena)."""
    nbytes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    sizes = [(n + 63) // 64 * 64 for n in nbytes]
    if not specs or not wanted(sum(sizes)):
        return None
    buffer = empty((sum(sizes),), torch.uint8)
    views, offset = [], 0
    for (shape, dtype), n, size in zip(specs, nbytes, sizes):
        views.append(buffer[offset : offset + n].view(dtype).view(shape))
        offset += size
    return buffer, views


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors copied, in order, into one `arena` -> views of it with their shapes and dtypes; the tensors
    themselves where the arena is not wanted. For many weights each under 2 MiB (a layer's linears) that one step
    streams in turn: alone, each would sit on ordinary pages."""
    made = arena(tensors)
    if made is None:
        return list(tensors)
    buffer, views = made
    for t, view in zip(tensors, views):
        view.copy_(t)
    settle(buffer)
    return views
