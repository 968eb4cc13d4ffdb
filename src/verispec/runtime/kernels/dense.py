"""verispec's own dense linear (`dense_kernel.cpp`): y = x W^T (+ b) for fp32 and bf16 weights packed once.

Why not oneDNN's packed linear: on an AVX-512-bf16 CPU it reads weights at about half the memory bandwidth at one
row, and it is row-invariant only up to 1024 inputs (the runner then splits wider weights into chunks). This kernel
streams each block of 16 output columns as one contiguous run, keeps a register tile of up to 6 rows x 4 blocks
(so 2..16 rows cost little more than one), and is row-invariant by construction: every output element is one
accumulator over k in increasing order, whatever the number of rows, the tile and the thread count (the kernel's
header says how). bf16 accumulates in fp32 with vdpbf16ps's arithmetic and rounds the output once: on vdpbf16ps
itself where the CPU issues it at the FMA rate (twice the multiply-adds: AMD Zen 4 class, measured once per process,
`kernel().vdpbf16ps_speedup()`), else as two exact FMAs a pair (on Intel CPUs without AMX vdpbf16ps issues at a
quarter of the FMA rate); the two give the same bits. fp32 uses FMA. Many rows: 12-row tiles over K passes whose
weight panel stays in L1.

Paths: "vdpbf16ps" (bf16 on AVX512_BF16's instruction; fp32 runs "avx512"), "avx512" (FMA; bf16 where the CPU has
AVX512_BF16, with vdpbf16ps's denormal rules), "avx2" (FMA; bf16 widened by a shift, exact), "scalar". The best one built for this CPU runs unless VERISPEC_DENSE_PATH names another, so a CI machine
with AVX-512 tests the AVX2 and scalar code too ("off": models pack their weights for oneDNN as before).
fp32 results are the same bits on every path; bf16 too, except where denormals occur (vdpbf16ps flushes them).
"""

from __future__ import annotations


import torch

from .. import overrides
from .ext import build
from .paths import KernelPath, numbers

# The kernel's paths (paths.py's numbers); "off": Linear packs for oneDNN instead.
PATHS = numbers(KernelPath.VDPBF16PS, KernelPath.AVX512, KernelPath.AVX2, KernelPath.SCALAR) | {"off": None}
PATH_ENV = "VERISPEC_DENSE_PATH"
BLOCK = 16  # output columns per packed block
DTYPES = (torch.float32, torch.bfloat16)


def kernel():
    """The C++ extension (built on first use, cached on disk: `ext.py`), or None where it cannot be built."""
    return build("dense", "dense_kernel.cpp")


_PATH: dict[torch.dtype, int] = {}  # dtype -> the path `linear` takes (a plain dict: torch.compile reads it freely)


def default_path(dtype: torch.dtype) -> int | None:
    """The path `linear` takes for dtype: VERISPEC_DENSE_PATH's where set, else the best built for this CPU.
    (A forced path this build lacks for the dtype runs the best one below it: the kernel falls back itself.)
    Read once per dtype; `reset_paths` reads the variable again."""
    if dtype not in _PATH:
        built = kernel().paths()[str(dtype).removeprefix("torch.")]  # best first
        forced = overrides.read(PATH_ENV)
        if forced is not None and forced not in PATHS:
            raise ValueError(f"{PATH_ENV}={forced!r}: choose one of {', '.join(PATHS)}")
        _PATH[dtype] = built[0] if forced is None else PATHS[forced]
    return _PATH[dtype]


def reset_paths() -> None:
    _PATH.clear()


def supports(weight: torch.Tensor) -> bool:
    """Whether `pack` takes this weight: a plain fp32/bf16 CPU tensor, the kernel built and not turned off."""
    return (isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dtype in DTYPES
            and weight.dim() == 2 and kernel() is not None and default_path(weight.dtype) is not None)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> the kernel's blocked layout, [out, in] fp32 or [out, in rounded up to even] bf16 elements:
    blocks of 16 output columns (the last one narrower where out % 16), each contiguous:
    fp32 [in][16], bf16 [in / 2][16][2] (pairs of inputs, as vdpbf16ps reads them)."""
    out, size = weight.shape
    w = weight.detach().contiguous()
    pairs = weight.dtype == torch.bfloat16
    if pairs and size % 2:
        w = torch.nn.functional.pad(w, (0, 1))  # a zero input column: the kernel's last pair is (x[in - 1], 0)
    width = w.shape[1]
    full = out // BLOCK * BLOCK

    def blocked(part: torch.Tensor) -> torch.Tensor:  # [cols, width] -> one or more blocks, flat
        cols = part.shape[0]
        if pairs:
            return part.view(-1, min(cols, BLOCK), width // 2, 2).permute(0, 2, 1, 3).reshape(-1)
        return part.view(-1, min(cols, BLOCK), width).transpose(1, 2).reshape(-1)

    parts = [blocked(w[:full])] if full else []
    if full < out:
        parts.append(blocked(w[full:]))
    return torch.cat(parts).view(out, width)


@torch.library.custom_op("verispec::dense_linear", mutates_args=())
def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, path: int) -> torch.Tensor:
    """x [rows, in] @ a packed weight [out, in(+1)] (+ bias fp32 [out]) -> [rows, out]. An opaque op to
    torch.compile: Inductor fuses everything around it and calls the kernel here."""
    return kernel().dense_linear(x, weight, _or_empty(bias), path)


@dense_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, path: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           path: int | None = None) -> torch.Tensor:
    """rows [rows, in] @ a packed weight (+ bias) -> [rows, out] in the weight's dtype (rows converted to it)."""
    rows = rows.to(weight.dtype)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    bias = None if bias is None else bias.float()
    path = default_path(weight.dtype) if path is None else path
    if path is None:  # packed before VERISPEC_DENSE_PATH became "off": the best path built
        path = PATHS["avx512"]
    if torch.compiler.is_compiling():
        return dense_linear(rows, weight, bias, path)
    # eager: the kernel itself, without the custom op's dispatch (tens of microseconds a call)
    return kernel().dense_linear(rows, weight, _or_empty(bias), path)


_EMPTY = torch.empty(0)


def _or_empty(bias: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if bias is None else bias
