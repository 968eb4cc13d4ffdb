"""`--dtype auto`: the weights dtype this machine is fast at, without giving up exactness.

bf16 halves the bytes a step reads, and a decode step is the weights' memory traffic, so bf16 pays where the CPU
has native bf16 dot products (AVX512_BF16, AMX-BF16, AVX-NE-CONVERT: oneDNN's packed bf16 kernels), and costs
where it has none (AVX2: bf16 is emulated, slower than fp32). On CUDA bf16 is native.

Exactness comes first: speculation must not change the target's greedy output. A bf16 verify pass is bit for bit
a one-token step only where the forward is width- and batch-invariant, which verispec's own C++ kernels are by
construction (`dense.py` for the linears, `fused.py` for attention and the small ops: decode steps and verify
passes are invariant in the default mode). So `auto` picks bf16 on a CPU with native bf16 only where those kernels are
built and the model runs on the native runner (`native=`); elsewhere it keeps fp32 and says why.
`BF16_GREEDY_EXACT` records the measurement that showed bf16 speculative greedy output equal to the bf16 target
alone (None would keep fp32 everywhere).
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")  # /proc/cpuinfo names

# The measurement that lets `auto` pick bf16 on a CPU with native bf16 (None: not yet exact). Measured on an
# AVX-512-bf16 CPU (Intel Xeon, avx512_bf16, avx512_vnni, avx_vnni, no AMX), 2 threads, 2026-11-25, with the C++
# kernels: `verispec bench --dtypes float32,bfloat16 --methods target,adaptive,hf-target --limit 1
# --max-new-tokens 128` (13 Spec-Bench prompts, default drafter ngram+verispec-draft-smollm2-135m): bf16 adaptive
# output = the bf16 target's in 13/13 (before the kernels: 0-4/13); bf16 target alone 52.9 tok/s vs fp32 37.0.
BF16_GREEDY_EXACT: str | None = "bf16 speculative greedy output equals the bf16 target alone (bench: 13/13)"
BF16_NOT_EXACT = ("bf16 speculative greedy output is not bit for bit the bf16 target's own without verispec's "
                  "row-invariant kernels ({equal})")
BF16_BENCH_EQUAL = "bench, 13 prompts, before the kernels: 0-4/13 equal"


def kernels_built() -> bool:
    """Whether verispec's row-invariant C++ kernels (dense linears, attention) are built on this machine."""
    from ..kernels import dense, fused

    return dense.kernel() is not None and fused.kernel() is not None


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
                 bf16_exact: str | None = BF16_GREEDY_EXACT, kernels: bool | None = None,
                 native: bool = True) -> tuple[torch.dtype, str]:
    """The `auto` dtype for a device and why: (dtype, reason). flags: the CPU's (default: this machine's);
    kernels: whether the row-invariant C++ kernels are built (default: this machine's); native: whether the model
    runs on the native runner (Hugging Face modeling's bf16 verify passes are not row-invariant)."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16, "bfloat16: CUDA has native bf16"
    flags = cpu_flags() if flags is None else flags
    native_flags = [flag for flag in NATIVE_BF16_FLAGS if flag in flags]
    if not native_flags:
        return torch.float32, "float32: this CPU has no native bf16 dot products (no avx512_bf16, amx_bf16 or " \
                              "avx_ne_convert), where bf16 is slower than fp32"
    has = f"float32: this CPU has {native_flags[0]} (bf16 would read half the bytes), but "
    if bf16_exact is None:
        return torch.float32, has + BF16_NOT_EXACT.format(equal=BF16_BENCH_EQUAL)
    if not native:
        return torch.float32, has + "the model runs on Hugging Face modeling, whose bf16 verify passes are not " \
                                    "row-invariant (speculation could change its greedy output)"
    if not (kernels_built() if kernels is None else kernels):
        return torch.float32, has + "verispec's row-invariant C++ kernels are not built here (no compiler?), " \
                                    "without which bf16 speculation could change the greedy output"
    return torch.bfloat16, f"bfloat16: this CPU has {native_flags[0]} and {bf16_exact}"


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu",
                  quantized: bool = False, native: bool = True) -> tuple[torch.dtype, str]:
    """A dtype name ('auto', 'float32', ...) or a torch dtype -> (dtype, why). ValueError naming the choices.
    quantized: the target runs on quantized weights (`--weights gguf`, `--quantization int8`), which compute in
    float32: 'auto' is float32. native: the target is in the native runner's family (`models.in_native_family`)."""
    if isinstance(dtype, torch.dtype):
        return dtype, f"{str(dtype).removeprefix('torch.')}: asked for"
    if dtype == "auto":
        if quantized:
            return torch.float32, "float32: quantized weights compute in float32"
        return choose_dtype(device, native=native)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose from {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype], f"{dtype}: asked for"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device, integer_activations: bool,
                           kernels: bool | None = None) -> tuple[torch.dtype, str]:
    """`--kv-cache-dtype` for a native runner -> (the cache's dtype, why). "auto": float16 where the linears compute
    with integer activations (`--activations q8`, GGUF blocks: another model than the fp32 conversion already) on
    the CPU kernels, whose attention reads a 16-bit cache at half the bytes; the model's dtype elsewhere (float
    weights and `--activations fp32` keep the conversion's values exactly). kernels: whether the layer kernel is
    built (default: this machine's)."""
    if name != "auto":
        if DTYPES[name].itemsize > model_dtype.itemsize:
            return model_dtype, (f"{dtype_name(model_dtype)}: the model's dtype (a {name} cache of "
                                 f"{dtype_name(model_dtype)} activations would hold nothing more)")
        return DTYPES[name], f"{name}: asked for"
    if device.type != "cpu" or not integer_activations:
        return model_dtype, (f"{dtype_name(model_dtype)}: the model's dtype (a 16-bit cache is the default only "
                             "with integer activations on the CPU kernels)")
    if kernels is None:
        from ..kernels import fused

        kernels = fused.kernel() is not None
    if not kernels:
        return model_dtype, f"{dtype_name(model_dtype)}: the model's dtype (the attention kernel is not built)"
    return torch.float16, ("float16: integer activations on the CPU kernels; attention reads half the bytes a step "
                           "(--kv-cache-dtype float32 keeps the computed values)")
