"""`--dtype auto`: the weights dtype this machine is fast at, without giving up exactness.

bf16 halves the bytes a step reads, and a decode step is the weights' memory traffic, so bf16 pays where the CPU
has native bf16 dot products (AVX512_BF16, AMX-BF16, AVX-NE-CONVERT: oneDNN's packed bf16 kernels), and costs
where it has none (AVX2: bf16 is emulated, slower than fp32). On CUDA bf16 is native.

Exactness comes first: speculation must not change the target's greedy output. Until the forward is width- and
batch-invariant in bf16 (issue "bit for bit"), a wide bf16 verify pass rounds differently from a one-token step
and flips near-ties, so `auto` keeps fp32 on CPU (and says why) while `BF16_GREEDY_EXACT` is None; set it to the
measurement that shows bf16 speculative greedy output equal to the bf16 target alone once that holds.
With `--batch-invariant` (native runner, `runtime/invariant.py`) bf16 speculation is bit for bit the bf16
target's own (tests/engine/test_invariance.py, the slow real-pair test), but that mode is opt-in (it costs speed),
so the gate stays on the default forward: None until the default is invariant.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")  # /proc/cpuinfo names

# The measurement that lets `auto` pick bf16 on a CPU with native bf16 (None: not yet exact). Last measured on an
# AVX-512-bf16 CPU (avx512_bf16, avx512_vnni, avx_vnni, no AMX), 1 thread: `verispec bench --methods
# target,adaptive --dtype bfloat16 --limit 1 --max-new-tokens 128 --probe-repeats 0` (13 Spec-Bench prompts, one
# per category, default drafter ngram+verispec-draft-smollm2-135m): adaptive output = the bf16 target's in 4/13.
BF16_GREEDY_EXACT: str | None = None
BF16_NOT_EXACT = ("bf16 speculative greedy output is not yet bit for bit the bf16 target's own (bench, 13 prompts, "
                  "default drafter, adaptive K: {equal}; issue 'bit for bit')")
BF16_BENCH_EQUAL = "4/13 equal"


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where it cannot be read, e.g. not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            match = re.search(r"^flags\s*:(.*)$", f.read(), re.MULTILINE)
    except OSError:
        return frozenset()
    return frozenset(match.group(1).split()) if match else frozenset()


def choose_dtype(device: str | torch.device = "cpu", flags: frozenset[str] | None = None,
                 bf16_exact: str | None = BF16_GREEDY_EXACT) -> tuple[torch.dtype, str]:
    """The `auto` dtype for a device and why: (dtype, reason). flags: the CPU's (default: this machine's)."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16, "bfloat16: CUDA has native bf16"
    flags = cpu_flags() if flags is None else flags
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in flags]
    if not native:
        return torch.float32, "float32: this CPU has no native bf16 dot products (no avx512_bf16, amx_bf16 or " \
                              "avx_ne_convert), where bf16 is slower than fp32"
    if bf16_exact is None:
        return torch.float32, (f"float32: this CPU has {native[0]} (bf16 would read half the bytes), but "
                               + BF16_NOT_EXACT.format(equal=BF16_BENCH_EQUAL))
    return torch.bfloat16, f"bfloat16: this CPU has {native[0]} and {bf16_exact}"


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu",
                  quantized: bool = False) -> tuple[torch.dtype, str]:
    """A dtype name ('auto', 'float32', ...) or a torch dtype -> (dtype, why). ValueError naming the choices.
    quantized: the target runs on quantized weights (`--weights gguf`, `--quantization int8`), which compute in
    float32: 'auto' is float32."""
    if isinstance(dtype, torch.dtype):
        return dtype, f"{str(dtype).removeprefix('torch.')}: asked for"
    if dtype == "auto":
        return (torch.float32, "float32: quantized weights compute in float32") if quantized else choose_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose from {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype], f"{dtype}: asked for"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
