"""A description of the machine a benchmark ran on, for the report header, and the physical floor of decoding.

The floor: a decode step of the target alone reads every weight once, so no step can take less than
weight bytes / memory bandwidth. `measure_bandwidth` measures that bandwidth on the benchmark's own device and
threads; `decode_floor` sets the measured batch-1 time per token of the target alone against it. For a GGUF target
run on its own blocks, the bytes come from the file's header (`gguf_step_bytes`): every tensor but the token
embedding, of which a step reads one row (unless the head is tied to it, when the head reads all of it).
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time

import torch

BANDWIDTH_BYTES = 512 * 2**20  # far larger than any CPU cache, so every read comes from memory
BANDWIDTH_REPEATS = 5


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The instruction-set features that decide which kernels and dtypes are fast (dtype choice, GGUF dot products).
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
              "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16", "i8mm")


def cpu_flags() -> list[str]:
    """The CPU's SIMD_FLAGS, from /proc/cpuinfo (empty where it is not readable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    present = set(line.split(":", 1)[1].split())
                    return [flag for flag in SIMD_FLAGS if flag in present]
    except OSError:
        pass
    return []


def measure_bandwidth(device: torch.device | str = "cpu", size_bytes: int = BANDWIDTH_BYTES,
                      repeats: int = BANDWIDTH_REPEATS) -> float:
    """Memory read bandwidth in bytes/s: the median of `repeats` timed sums over a float32 tensor of `size_bytes`,
    with torch's configured threads (what the engine's own kernels get). One untimed sum comes first."""
    device = torch.device(device)
    data = torch.ones(max(1, size_bytes // 4), dtype=torch.float32, device=device)  # [n]; every page touched
    reads = 10 if device.type == "cuda" else 1  # a GPU sums 512 MB in well under a millisecond: time several

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(reads):
            data.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / reads

    timed()
    seconds = statistics.median(timed() for _ in range(repeats))
    return data.numel() * data.element_size() / seconds


@functools.lru_cache(maxsize=None)
def _bandwidth_gb_s(device: str, threads: int) -> float:
    """Measured once per process for each device and thread count (the demos describe the machine per demo)."""
    return round(measure_bandwidth(device) / 1e9, 1)


def describe_machine(device: torch.device | str) -> dict:
    import transformers

    from ..runtime.model.dtype import NATIVE_BF16_FLAGS, choose_dtype, cpu_flags, dtype_name

    device = torch.device(device)
    auto, why = choose_dtype(device)
    info = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx")) or f in NATIVE_BF16_FLAGS),
        "dtype_auto": dtype_name(auto),
        "dtype_auto_reason": why,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "memory_bandwidth_gb_s": _bandwidth_gb_s(str(device), torch.get_num_threads()),
        "memory_bandwidth_method": f"median of {BANDWIDTH_REPEATS} timed sums over a {BANDWIDTH_BYTES >> 20} MiB "
                                   f"float32 tensor on {device}, {torch.get_num_threads()} torch threads",
    }
    return info


def machine_line(info: dict) -> str:
    where = info["gpu"] or f"{info['cpu']} ({info['logical_cpus']} logical CPUs, {info['torch_threads']} torch threads)"
    if info.get("cpu_flags") is not None:
        where += f" | CPU flags {' '.join(info['cpu_flags']) or '(none listed)'}"
    bandwidth = info.get("memory_bandwidth_gb_s")
    measured = "" if bandwidth is None else f" | memory bandwidth {bandwidth:g} GB/s measured"
    load = "" if info.get("load_average_1m") is None else f" | load average {info['load_average_1m']} at start"
    bf16 = [f for f in info.get("cpu_flags", []) if "bf16" in f or f == "avx_ne_convert"]
    flags = f" | bf16 flags {','.join(bf16) or 'none'}" if info["gpu"] is None else ""
    auto = f" | dtype auto: {info['dtype_auto_reason']}" if info.get("dtype_auto_reason") else ""
    return (f"{where}{measured}{flags} | torch {info['torch']} | transformers {info['transformers']} | "
            f"Python {info['python']}{load}{auto}")


TOKEN_EMBEDDING = "token_embd.weight"  # GGUF's names: the embedding table and the separate LM head
LM_HEAD = "output.weight"


def gguf_tensor_bytes(info) -> int:
    """Bytes of one GGUF tensor as stored (`gguf_file.TensorInfo`; types verispec does not read: gguf-py's sizes)."""
    from ..runtime.weights.gguf_file import GGML_TYPES

    if info.type_id in GGML_TYPES:
        return info.nbytes
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(info.type_id)]
    count = 1
    for dim in info.shape:
        count *= dim
    return count // block * size


def gguf_step_bytes(path) -> tuple[int, str]:
    """-> (the bytes of a GGUF file's tensors one decode step reads, how they were counted), from its header.

    Every tensor counts but the token embedding, of which a step reads one row per token; where the file has no
    separate LM head (`output.weight`), the head is tied to the embedding and reads all of it, so it counts."""
    from ..runtime.weights.gguf_file import open_gguf

    sizes = {info.name: gguf_tensor_bytes(info) for info in open_gguf(path).tensors}
    tied = LM_HEAD not in sizes and TOKEN_EMBEDDING in sizes
    total = sum(n for name, n in sizes.items() if name != TOKEN_EMBEDDING or tied)
    how = ("the GGUF file's tensors as stored, the token embedding counted as the tied LM head" if tied else
           f"the GGUF file's tensors as stored but the token embedding "
           f"({sizes.get(TOKEN_EMBEDDING, 0) / 2**20:.1f} MB, one row read per token)")
    return total, how


def decode_floor(weight_bytes: int, bandwidth_gb_s: float, tokens: int, seconds: float, weights: str = "") -> dict:
    """The target alone at batch 1 (`tokens` generated in `seconds`, prefill included) against the floor: one
    step reads every weight once, so it takes at least weight bytes / bandwidth (`weights`: what those bytes are)."""
    floor_ms = weight_bytes / (bandwidth_gb_s * 1e9) * 1e3
    measured_ms = seconds / tokens * 1e3
    out = {
        "target_weight_mb": round(weight_bytes / 2**20, 2),
        "memory_bandwidth_gb_s": bandwidth_gb_s,
        "floor_ms_per_token": round(floor_ms, 4),
        "ceiling_tokens_per_s": round(1e3 / floor_ms, 1),
        "target_ms_per_token": round(measured_ms, 4),
        "target_tokens_per_s": round(1e3 / measured_ms, 2),
        "x_floor": round(measured_ms / floor_ms, 2),
    }
    if weights:
        out["weights_counted"] = weights
    return out


def floor_line(floor: dict) -> str:
    ceiling = (f" = a ceiling of {floor['ceiling_tokens_per_s']:.4g} tok/s against {floor['target_tokens_per_s']:.4g} "
               f"tok/s measured" if "ceiling_tokens_per_s" in floor else "")  # reports written before the ceiling
    counted = f": {floor['weights_counted']}" if floor.get("weights_counted") else ""
    return (f"target alone at batch 1: {floor['target_ms_per_token']:.2f} ms/token = {floor['x_floor']:.1f}x the "
            f"floor of {floor['floor_ms_per_token']:.3g} ms{ceiling} (weights {floor['target_weight_mb']:.4g} MB read "
            f"per step{counted} / {floor['memory_bandwidth_gb_s']:g} GB/s)")
