"""Peak memory of one generation call, above what was resident just before it.

CPU (Linux): freed heap is handed back to the OS (`malloc_trim`), the kernel's peak-RSS mark is reset (writing
"5" to /proc/self/clear_refs), and after the call the peak (VmHWM) minus the RSS before the call is the memory
the call itself needed: activations, logits and any cache it allocated. CUDA: `max_memory_allocated` after
`reset_peak_memory_stats`, minus `memory_allocated` before. Weights and the engine's preallocated KV caches
are resident before the call, so the report adds them separately (see `persistent_bytes`).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys

import torch


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _trim_heap() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """`with PeakMemory(device) as m: ...` then `m.peak_bytes` (None when the platform cannot tell)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.peak_bytes: int | None = None
        self._before = 0
        self._resettable = False

    @property
    def method(self) -> str:
        return "cuda max_memory_allocated" if self.device.type == "cuda" else "peak RSS (VmHWM) above pre-call RSS"

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
            return self
        _trim_heap()
        self._resettable = _reset_peak_rss()
        self._before = (_status_kib("VmRSS") or 0) * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._before)
            return
        peak = _status_kib("VmHWM")
        if self._resettable and peak is not None:
            self.peak_bytes = max(0, peak * 1024 - self._before)


def persistent_bytes(runner) -> int:
    """Bytes of a HFRunner's preallocated KV buffers (kept across calls, so resident before each call)."""
    return sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in runner.cache.layers
        if getattr(layer, "is_initialized", False)
    )
