"""The kernels' code paths: one numbering for every C++ kernel that takes a path number (`dense_kernel.cpp`,
`quant_kernel.cpp`'s `Path` in quant_common.h, and `layer_loop.h`, which passes both on). A path is the instruction
set a call runs on; each kernel's module says which it builds and how it picks one (dense.py `default_path`,
quant.py `KERNEL_PATH`), and `VERISPEC_DENSE_PATH` / `VERISPEC_QUANT_PATH` name them in lower case.
(The attention kernel's paths, fused.py `PATHS`, are another axis: how a call walks the queries, not the ISA.)"""

from __future__ import annotations

from enum import IntEnum


class KernelPath(IntEnum):
    AUTO = -1  # the best path built for this CPU (the quant kernel resolves it itself: `resolve_path`)
    SCALAR = 0
    AVX2 = 1  # with FMA (and F16C: the quant kernel)
    AVX512 = 2
    VDPBF16PS = 3  # AVX-512 bf16 on vdpbf16ps itself: the dense kernel's bf16 weights only


def numbers(*paths: KernelPath) -> dict[str, int]:
    """{lower-case name: number} of `paths` (plain ints: what the kernels and torch.compile's custom ops take)."""
    return {path.name.lower(): int(path) for path in paths}
