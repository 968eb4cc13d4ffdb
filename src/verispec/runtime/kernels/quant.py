"""Weight-only quantized linears: GGUF blocks as they are in the file (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants
Q4_K, Q5_K, Q6_K: `NATIVE_TYPES`, decoded by quant_k.h) and per-channel int8.

A `QuantWeight` stands where a `[out, in]` weight tensor stands in `llama.py` (`Linear`, the embedding, the tied LM
head): it answers `F.linear`, `F.embedding` and `torch.cat` along the output dimension through the
`__torch_function__` protocol, so the model code is the same for every weight format.
The values are exactly those gguf-py dequantizes (the fp32 conversion's), one float32 rounding per operation:
Q4_0 `d * (q - 8)`, Q4_1 `d * q + m`, Q8_0 `d * q`, fp16 `d`, `m` per 32 weights; int8 `scale[o] * q`; the 5-bit and
K-quant formulas in quant_k.h (one rounding at most, as gguf-py's). A fused weight whose parts differ in type is a
`stack` (each part run as itself).
`F.linear` runs `quant_kernel.cpp` (built once per torch version and CPU flags under ~/.cache/verispec/ext), which
dequantizes a block once in registers and multiplies it into a tile of rows; without a compiler it falls back to
dequantize-then-matmul (same values, slower). Outputs equal the fp32 conversion's up to summation order.
The kernel has an AVX-512, an AVX2 (+FMA, F16C) and a scalar path (paths.py `KernelPath`), each with its own fixed
summation order; the best one the CPU runs is used, or the one `VERISPEC_QUANT_PATH` (avx512, avx2, scalar; read at
start-up) names.
Q4_0, Q4_1, Q5_0 and Q5_1 blocks are repacked once, when a `QuantWeight`'s `packed` is first read (`pack_q4`: the
same bytes reordered, so channels come in groups of 4 whose nibbles share 32-bit lanes and whose fp16 scales are
contiguous; only the last group's padding is added), into the layout the kernel reads fastest; `QuantWeight.data`
gives the file's bytes back. K-quants keep the file's layout (their fp32-activation tiles decode a super-block's
scales once).

Integer activations (`activations="q8"`, quant_q8.h): the GGUF block types as llama.cpp computes them, activations
quantized per row in blocks of 32 to int8 (one fp32 scale a block), exact integer dot products per block, the blocks
combined in fp32 in one fixed order: another model than the fp32 conversion (as bf16 is), with the same bits on
every kernel path and in any batch. Its weights are repacked into the "V" layouts (`pack_v`: channels in groups of
16, each 32-bit lane 4 consecutive weights of one channel, what vpdpbusd multiplies); it needs the kernel built.
The K-quants take the same activations (one scale per 32 inputs, which each of their sub-blocks of 32 or 16 meets
whole: quant_vk.h) from their "VK" layouts (quant_vk.py `pack_vk`: records of 16 channels, the 6-bit scales a byte
each: 1.03x the file's bytes for Q4_K / Q5_K, 1.00x for Q6_K).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from .. import overrides
from .ext import build
from .paths import KernelPath, numbers
from .quant_vk import RECORD, SUPER, VK_GROUP, pack_vk, unpack_vk

# GGML types with blocks of 32 weights -> (bytes per block, kernel id = the GGML type id); INT8 is verispec's own.
GGML_BLOCKS = {"Q4_0": (18, 2), "Q4_1": (20, 3), "Q5_0": (22, 6), "Q5_1": (24, 7), "Q8_0": (34, 8)}
# K-quants: super-blocks of 256 weights (quant_k.h) -> (bytes per super-block, kernel id = the GGML type id)
K_BLOCKS = {"Q4_K": (144, 12), "Q5_K": (176, 13), "Q6_K": (210, 14)}
SUPER_BLOCK = 256
NATIVE_TYPES = tuple(GGML_BLOCKS) + tuple(K_BLOCKS)  # the GGUF block types the kernel runs
INT8 = ("INT8", 100)
REPACKED = {"Q4_0": 102, "Q4_1": 103, "Q5_0": 106, "Q5_1": 107}  # block type -> its repacked layout's id (`pack_q4`)
GROUP = 4  # output channels per row of a repacked weight
REPACK = True  # False: Q4 weights made from now on keep the file's layout (recipes compare the two side by side)
# block type -> the kernel id of its integer-activation layout (V: `pack_v`; the K-quants' VK: quant_vk.py)
V_LAYOUTS = {"Q4_0": 202, "Q4_1": 203, "Q5_0": 206, "Q5_1": 207, "Q8_0": 208, "Q4_K": 212, "Q5_K": 213, "Q6_K": 214}
V_GROUP = 16  # output channels per row of a V layout
ACTIVATIONS = ("fp32", "q8")  # fp32: the dequantized weights times the fp32 activations; q8: integer activations
BLOCK = 32
PATHS = numbers(KernelPath.AUTO, KernelPath.SCALAR, KernelPath.AVX2, KernelPath.AVX512)  # the kernel's code paths


def _path_from_env() -> int:
    name = overrides.read("VERISPEC_QUANT_PATH", "auto").lower()
    if name not in PATHS:
        raise ValueError(f"VERISPEC_QUANT_PATH={name!r}: choose from {', '.join(PATHS)}")
    return PATHS[name]


KERNEL_PATH = _path_from_env()  # what F.linear on a QuantWeight runs (tests pass a path to `linear` instead)


_KERNEL: list = []  # the extension (or None), once looked up


def kernel():
    """The C++ extension (built on first use, cached on disk: `ext.py`), or None where it cannot be built."""
    if not _KERNEL:
        _KERNEL.append(build("quant", "quant_kernel.cpp"))
    return _KERNEL[0]


def set_prefetch(from_rows: int, upto_rows: int, distance: int, to_l2: bool) -> tuple[int, int, int, bool]:
    """How the integer-activation tiles ask for their weights ahead (tiles of >= `from_rows` rows in calls of <=
    `upto_rows` rows, `distance` bytes ahead, into L2 or L1: quant_unpack.h `TilePrefetch`) -> the setting it replaces.
    Hints only: outputs are unchanged. For measurements (`recipes/tile_prefetch_bench.py`); the default is what was
    measured fastest."""
    module = _built()
    old = tuple(module.get_prefetch())
    module.set_prefetch(from_rows, upto_rows, distance, to_l2)
    return old


def set_row_block(rows: int) -> int:
    """Rows a pass of the integer-activation linears over their weights takes at most (0: every row at once;
    quant_q8.h `v_row_block`) -> the old value. Outputs are unchanged; for measurements (recipes/tile_prefetch_bench.py
    `--row-blocks`)."""
    return _built().set_row_block(rows)


def _built():
    """The extension, for the settings above (RuntimeError where it is not built)."""
    module = kernel()
    if module is None:
        raise RuntimeError("the quant kernel is not built here")
    return module


class Deferred:
    """A GGUF tensor's [out, row_bytes] blocks, read when first needed (`load()`): a model's blocks are then never
    all in memory beside their packed copies (each is read, packed into its place in the weights' arena and let go:
    `llama.onto_huge_pages`), so a start's peak memory stays near the file's size."""

    def __init__(self, shape, load, mapped=None) -> None:
        self.shape = torch.Size(shape)
        self.load = load  # () -> [out, row_bytes] uint8, a copy
        self.mapped = mapped  # None, or () -> a context giving the bytes without a copy (the file's own pages)

    @staticmethod
    def cat(parts: list) -> Deferred:
        """The parts (Deferred or tensors, one row size) stacked along the rows, read when first needed."""
        rows = sum(p.shape[0] for p in parts)

        def load() -> torch.Tensor:
            out = torch.empty(rows, parts[0].shape[1], dtype=torch.uint8)
            at = 0
            for part in parts:
                with blocks_of(part) as data:
                    out[at : at + data.shape[0]] = data
                at += part.shape[0]
            return out

        return Deferred((rows, parts[0].shape[1]), load)


def materialize(data) -> torch.Tensor:
    """The bytes of `data` (a tensor, or a `Deferred` read now)."""
    return data.load() if isinstance(data, Deferred) else data


@contextmanager
def blocks_of(data):
    """The bytes of `data` for a `with` block: a Deferred's straight from the file's pages where it can (let go
    after), else a copy; a tensor as it is."""
    if isinstance(data, Deferred) and data.mapped is not None:
        with data.mapped() as view:
            yield view
    else:
        yield materialize(data)


class QuantWeight:
    """A quantized `[out, in]` weight: `packed` uint8, what the kernel reads (Q4_0 / Q4_1: `pack_q4`'s
    `[ceil(out / 4), 4 * row_bytes]`; else the file's `[out, row_bytes]` GGUF blocks, or int8 values), `scales`
    `[out]` float32 (int8 only)."""

    dtype = torch.float32  # what it computes in and hands back
    device = torch.device("cpu")

    def __init__(self, qtype: str, data: torch.Tensor, in_features: int, scales: torch.Tensor | None = None,
                 activations: str = "fp32"):
        """data: [out, row_bytes] uint8 as the file has it (int8: the values). activations: "fp32", or "q8" (a GGUF
        block type's integer activations: needs the kernel)."""
        if in_features % (SUPER_BLOCK if qtype in K_BLOCKS else BLOCK):
            raise ValueError(f"a {qtype} weight's input size must be a multiple of "
                             f"{SUPER_BLOCK if qtype in K_BLOCKS else BLOCK}, got {in_features}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations={activations!r}: choose from {', '.join(ACTIVATIONS)}")
        if activations == "q8" and qtype not in V_LAYOUTS:
            raise ValueError(f"integer activations run the GGUF block types {', '.join(V_LAYOUTS)}, not {qtype}")
        self.qtype, self.scales, self.activations = qtype, scales, activations
        self._scales_arg = _or_empty(scales)  # what the kernel takes (made once: it is passed every call)
        self.shape = torch.Size((data.shape[0], in_features))
        if activations == "q8":
            self._file, self.kernel_id = data, V_LAYOUTS[qtype]  # `packed` made on first use: `__getattr__`
        elif qtype in REPACKED and REPACK:
            self._file, self.kernel_id = data, REPACKED[qtype]
        else:
            self.packed = materialize(data).contiguous()
            self.kernel_id = INT8[1] if qtype == INT8[0] else kernel_id(qtype)

    @classmethod
    def repacked(cls, qtype: str, packed: torch.Tensor, out: int, in_features: int) -> QuantWeight:
        """A Q4_0 / Q4_1 weight of `out` channels from blocks already in `pack_q4`'s layout."""
        weight = cls.__new__(cls)
        weight.qtype, weight.scales, weight._scales_arg, weight.activations = qtype, None, _or_empty(None), "fp32"
        weight.shape = torch.Size((out, in_features))
        weight.packed, weight.kernel_id = packed, REPACKED[qtype]
        return weight

    def __getattr__(self, name: str):
        # A repacked weight keeps the file's blocks (`_file`) until `packed` is first read, and is packed then, once:
        # so `cat` fuses q/k/v and gate/up from the file's bytes and packs only the fused weight, never each part and
        # then (after unpacking them) the stack. Only called for names not set: every other one is missing.
        file = self.__dict__.get("_file") if name == "packed" else None
        if file is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        with blocks_of(file) as data:  # (the file's own pages where it can: no copy, as pack_into reads them)
            packed = pack_v(data, self.qtype) if self.kernel_id in V_LAYOUTS.values() else pack_q4(data, self.qtype)
        packed = self.__dict__.setdefault("packed", packed)  # (two threads here pack the same bytes; one is kept)
        self.__dict__.pop("_file", None)
        return packed

    def __repr__(self) -> str:
        return f"QuantWeight({self.qtype}, {tuple(self.shape)})"

    def packed_spec(self) -> tuple[torch.Size, torch.dtype]:
        """The shape and dtype `packed` has (or will have once packed: from the blocks' shape, nothing read)."""
        if "_file" not in self.__dict__:
            return self.packed.shape, self.packed.dtype
        return self._packed_shape(), torch.uint8

    def _packed_shape(self) -> torch.Size:
        out, row = self.__dict__["_file"].shape
        if self.kernel_id in V_LAYOUTS.values():
            width = VK_GROUP * RECORD[self.qtype] * (row // SUPER[self.qtype]) if self.qtype in K_BLOCKS \
                else V_GROUP * row
            return torch.Size((-(-out // V_GROUP), width))
        return torch.Size((-(-out // GROUP), GROUP * row))

    def pack_into(self, view: torch.Tensor) -> None:
        """Pack (where not packed yet: straight into `view`, for V / VK layouts) or move `packed` into `view` (a
        place in the weights' arena, of `packed_spec()`); the blocks' own copies are let go."""
        file = self.__dict__.get("_file")
        if file is not None and self.kernel_id in V_LAYOUTS.values():
            with blocks_of(file) as data:
                pack_v(data, self.qtype, into=view)
            self.__dict__.pop("_file")
        else:
            packed = self.packed
            if packed.shape != view.shape:
                raise AssertionError(f"{self}: packed {tuple(packed.shape)}, its place {tuple(view.shape)}")
            view.copy_(packed)
        self.packed = view

    @property
    def data(self) -> torch.Tensor:
        """[out, row_bytes] uint8: the blocks as the file has them (a copy where they are repacked already)."""
        if self.kernel_id == STACK:
            raise TypeError("a stack of weights of different types has no one row layout: see its .parts")
        if "_file" in self.__dict__:  # not packed yet
            return materialize(self.__dict__["_file"])
        if self.kernel_id in V_LAYOUTS.values():
            return unpack_v(self.packed, self.qtype, self.shape[0])
        return unpack_q4(self.packed, self.qtype, self.shape[0]) if self.kernel_id in REPACKED.values() else self.packed

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[out, in] float32 (or the chosen rows' [n, in]): exactly gguf-py's values."""
        if self.kernel_id == STACK:
            values = torch.cat([p.dequantize() for p in self.parts])  # [out, in]
            return values if rows is None else values[rows.reshape(-1)]
        ext = kernel()
        if ext is not None:
            ids = torch.empty(0, dtype=torch.int64) if rows is None else rows.reshape(-1)
            return ext.dequantize(self.packed, self._scales_arg, self.kernel_id, self.shape[1], self.shape[0],
                                  ids)
        data = self.data if rows is None else self.data[rows]
        scales = None if self.scales is None else (self.scales if rows is None else self.scales[rows])
        return dequantize_reference(self.qtype, data, self.shape[1], scales)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, path: int | None = None) -> torch.Tensor:
        """[..., in] -> [..., out]; path: one of PATHS' values (default KERNEL_PATH). Called ~120 times a decode
        step: a 2-d float32 x goes to the kernel with no other torch op on the way (each costs ~1 µs)."""
        ext = kernel()
        flat = x.dim() == 2
        rows = x if flat else x.reshape(-1, self.shape[1])  # [rows, in]
        if rows.dtype != torch.float32:
            rows = rows.float()
        if ext is None and self.activations in ("q8", "mixed"):
            raise RuntimeError("integer activations need the quant kernel, which is not built here")
        if ext is not None:
            y = ext.quant_linear(rows, self.packed, self._scales_arg, self.kernel_id, self.shape[1], self.shape[0],
                                 KERNEL_PATH if path is None else path)  # [rows, out]
        else:
            y = rows @ self.dequantize().T
        if bias is not None:
            y = y + bias
        if not flat:
            y = y.view(*x.shape[:-1], self.shape[0])
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return weight.linear(x, bias)
        if func is F.embedding:
            ids, weight = args[0], args[1]
            return weight.dequantize(ids.reshape(-1)).view(*ids.shape, weight.shape[1])
        if func is torch.cat and all(isinstance(w, QuantWeight) for w in args[0]):
            return cat(list(args[0]))
        raise TypeError(f"QuantWeight does not support {getattr(func, '__name__', func)}")


def cat(weights: list[QuantWeight]) -> QuantWeight:
    """Weights of one input size stacked along the output dimension (fused q/k/v, gate/up). Of one type and
    activations: repacked weights whose sizes are whole groups stack as they are (`pack_q4` keeps each group of 4
    channels in one row: the same bytes as repacking the stack); others are stacked as the file's blocks and
    repacked (weights fused at load are not packed yet: their blocks stack as they came, and only the stack is
    packed). Of several (a K-quant file's q/k/v can mix Q5_0 and Q8_0): a `stack` of them."""
    first = weights[0]
    if any(w.shape[1] != first.shape[1] for w in weights):
        raise ValueError("only quantized weights of one input size fuse")
    if any(w.qtype != first.qtype or w.activations != first.activations for w in weights):
        return stack(weights)
    if first.kernel_id in REPACKED.values() and all(w.kernel_id == first.kernel_id and w.shape[0] % GROUP == 0
                                                    for w in weights):
        return QuantWeight.repacked(first.qtype, torch.cat([w.packed for w in weights]),
                                    sum(w.shape[0] for w in weights), first.shape[1])
    scales = None if first.scales is None else torch.cat([w.scales for w in weights])
    if all(isinstance(w.__dict__.get("_file"), Deferred) for w in weights):  # nothing read yet: nor now
        data = Deferred.cat([w.__dict__["_file"] for w in weights])
    else:
        data = torch.cat([w.data for w in weights])
    return QuantWeight(first.qtype, data, first.shape[1], scales, first.activations)


STACK = 300  # the kernel id of a stack of weights of different types (quant_kernel.cpp stack_linear)


def stack(weights: list[QuantWeight]) -> QuantWeight:
    """Weights of different block types (or activations) stacked along the output dimension, each part kept in its
    own layout and run as itself (its outputs are the part's alone, bit for bit): one uint8 [1, bytes] tensor of an
    int64 header (parts; per part kernel id, out, data rows, data row bytes, byte offset) and the parts' data, each
    at a 64-byte boundary; the parts become views into it (no second copy)."""
    parts = [p for w in weights for p in (w.parts if w.kernel_id == STACK else [w])]
    if any(p.scales is not None for p in parts):
        raise ValueError("int8 weights (per-channel scales) do not stack with others")
    offset = -(-8 * (1 + 5 * len(parts)) // 64) * 64
    header, offsets = [len(parts)], []
    for p in parts:
        offsets.append(offset)
        header += [p.kernel_id, p.shape[0], p.packed.shape[0], p.packed.shape[1], offset]
        offset += -(-p.packed.numel() // 64) * 64
    blob = torch.zeros(1, offset, dtype=torch.uint8)
    blob[0, : 8 * len(header)] = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    views = []
    for p, at in zip(parts, offsets):
        view = blob[0, at : at + p.packed.numel()].view(p.packed.shape)
        view.copy_(p.packed)
        part = QuantWeight.__new__(QuantWeight)
        part.__dict__.update(p.__dict__)
        part.packed = view
        views.append(part)
    weight = QuantWeight.__new__(QuantWeight)
    acts = {p.activations for p in parts}
    weight.qtype = "+".join(dict.fromkeys(p.qtype for p in parts))
    weight.scales, weight._scales_arg = None, _or_empty(None)
    weight.activations = acts.pop() if len(acts) == 1 else "mixed"
    weight.shape = torch.Size((sum(p.shape[0] for p in parts), parts[0].shape[1]))
    weight.packed, weight.kernel_id, weight.parts = blob, STACK, views
    return weight


# The fields of a block a repacked group stores after its nibbles, in order: (first byte in the file's block, bytes).
_GROUP_FIELDS = {"Q4_0": [(0, 2)], "Q4_1": [(0, 2), (2, 2)], "Q5_0": [(2, 4), (0, 2)], "Q5_1": [(4, 4), (0, 2), (2, 2)]}


def pack_q4(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """[out, row_bytes] Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks -> [ceil(out / 4), 4 * row_bytes], the kernel's layout: per
    group of 4 channels, for every block its 64 nibble bytes (byte 4 * j + c = byte j of channel c's 16), then (Q5)
    every block's 4 u32 qh (the fifth bits), then every block's 4 fp16 d, then (Q4_1, Q5_1) every block's 4 fp16 m.
    The same bytes; a last group short of 4 channels is padded with zeros (d = m = 0), which the kernel computes but
    never returns. (Moved in numpy: its strided byte copies are ~50x faster than torch's on these shapes.)"""
    out, size = data.shape[0], GGML_BLOCKS[qtype][0]
    groups = -(-out // GROUP)
    raw = data.contiguous().numpy()
    if groups * GROUP != out:
        raw = np.concatenate([raw, np.zeros((groups * GROUP - out, raw.shape[1]), dtype=np.uint8)])
    blocks = raw.reshape(groups, GROUP, -1, size)  # [groups, 4, blocks, size]
    parts = [blocks[..., size - 16 :].transpose(0, 2, 3, 1)]  # nibbles [groups, blocks, 16, 4]
    parts += [blocks[..., s : s + w].transpose(0, 2, 1, 3) for s, w in _GROUP_FIELDS[qtype]]  # [g, blocks, 4, w]
    return torch.from_numpy(np.concatenate([p.reshape(groups, -1) for p in parts], axis=1))


def unpack_q4(packed: torch.Tensor, qtype: str, out: int) -> torch.Tensor:
    """`pack_q4`'s inverse: [ceil(out / 4), 4 * row_bytes] -> [out, row_bytes], the file's bytes."""
    groups, size = packed.shape[0], GGML_BLOCKS[qtype][0]
    n = packed.shape[1] // (GROUP * size)  # blocks per channel
    raw = packed.contiguous().numpy()
    blocks = np.empty((groups, GROUP, n, size), dtype=np.uint8)
    blocks[..., size - 16 :] = raw[:, : n * 64].reshape(groups, n, 16, GROUP).transpose(0, 3, 1, 2)
    at = n * 64
    for s, w in _GROUP_FIELDS[qtype]:
        blocks[..., s : s + w] = raw[:, at : at + n * GROUP * w].reshape(groups, n, GROUP, w).transpose(0, 2, 1, 3)
        at += n * GROUP * w
    return torch.from_numpy(blocks.reshape(groups * GROUP, -1)[:out].copy())


# Q5's fifth bits in a V layout: bit j of the file's qh (element j) goes to bit V_Q5_BITS[j] (quant_q8.h v_q5_bit)
V_Q5_BITS = [8 * (j % 4) + j // 4 if j < 16 else 8 * ((j - 16) % 4) + 4 + (j - 16) // 4 for j in range(32)]


def _v_fields(qtype: str) -> tuple[int, int, list[int]]:
    """(first quant byte, quant bytes, the fp16 fields' first bytes in storage order) of a block in the file."""
    size = GGML_BLOCKS[qtype][0]
    if qtype == "Q8_0":
        return 2, 32, [0]
    scales = [0, 2] if qtype in ("Q4_1", "Q5_1") else [0]
    return size - 16, 16, scales


def _spread_qh(qh: np.ndarray, inverse: bool = False) -> np.ndarray:
    """[...] uint32 qh words with their bits moved to V_Q5_BITS' places (inverse: back)."""
    out = np.zeros_like(qh)
    for j, to in enumerate(V_Q5_BITS):
        src, dst = (to, j) if inverse else (j, to)
        out |= ((qh >> np.uint32(src)) & np.uint32(1)) << np.uint32(dst)
    return out


def pack_v(data: torch.Tensor, qtype: str, into: torch.Tensor | None = None) -> torch.Tensor:
    """[out, row_bytes] Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks -> [ceil(out / 16), 16 * row_bytes], the
    integer-activation kernel's layout (quant_q8.h): per group of 16 channels, for every block its quants as
    [chunks][16 channels][4 bytes] (a chunk: the file's quant bytes 4i .. 4i + 3 of each channel) and (Q5) its
    [16 channels] u32 fifth bits (V_Q5_BITS' order), then every block's 16 fp16 d, then (Q4_1, Q5_1) every block's
    16 fp16 m. The same bytes; a last group short of 16 channels is padded with zeros (computed, never returned).
    K-quants: `pack_vk`'s records. Moved by quant_pack.h where the kernel is built, else by `pack_v_reference`.
    into: where to write them (a contiguous uint8 tensor of their shape), -> into."""
    if qtype in K_BLOCKS:
        return pack_vk(data, qtype, into)
    ext = kernel()
    if ext is not None:
        return ext.pack_v(data, kernel_id(qtype), into)
    packed = pack_v_reference(data, qtype)
    return packed if into is None else into.copy_(packed)


def pack_v_reference(data: torch.Tensor, qtype: str) -> torch.Tensor:
    """`pack_v` of the 32-weight blocks in numpy (the fallback, and the reference the C++ is tested against)."""
    out, size = data.shape[0], GGML_BLOCKS[qtype][0]
    first, count, scales = _v_fields(qtype)
    groups = -(-out // V_GROUP)
    raw = data.contiguous().numpy()
    if groups * V_GROUP != out:
        raw = np.concatenate([raw, np.zeros((groups * V_GROUP - out, raw.shape[1]), dtype=np.uint8)])
    blocks = raw.reshape(groups, V_GROUP, -1, size)  # [groups, 16, blocks, size]
    n = blocks.shape[2]
    quants = blocks[..., first : first + count].reshape(groups, V_GROUP, n, -1, 4).transpose(0, 2, 3, 1, 4)
    quants = quants.reshape(groups, n, -1)  # [g, blocks, chunks * 16 * 4]
    if qtype in ("Q5_0", "Q5_1"):
        qh = np.ascontiguousarray(blocks[..., first - 4 : first]).view(np.uint32)[..., 0]  # [g, 16, blocks]
        spread = _spread_qh(qh).transpose(0, 2, 1)  # [g, blocks, 16]
        quants = np.concatenate([quants, np.ascontiguousarray(spread).view(np.uint8).reshape(groups, n, -1)], axis=2)
    parts = [quants] + [blocks[..., s : s + 2].transpose(0, 2, 1, 3) for s in scales]  # d, m [g, blocks, 16, 2]
    return torch.from_numpy(np.concatenate([part.reshape(groups, -1) for part in parts], axis=1))


def unpack_v(packed: torch.Tensor, qtype: str, out: int) -> torch.Tensor:
    """`pack_v`'s inverse: [ceil(out / 16), 16 * row_bytes] -> [out, row_bytes], the file's bytes."""
    if qtype in K_BLOCKS:
        return unpack_vk(packed, qtype, out)
    ext = kernel()
    return unpack_v_reference(packed, qtype, out) if ext is None else ext.unpack_v(packed, kernel_id(qtype), out)


def unpack_v_reference(packed: torch.Tensor, qtype: str, out: int) -> torch.Tensor:
    """`unpack_v` of the 32-weight blocks in numpy (the fallback, and the reference)."""
    groups, size = packed.shape[0], GGML_BLOCKS[qtype][0]
    first, count, scales = _v_fields(qtype)
    q5 = qtype in ("Q5_0", "Q5_1")
    n = packed.shape[1] // (V_GROUP * size)  # blocks per channel
    per_block = V_GROUP * (count + 4 * q5)
    raw = packed.contiguous().numpy()
    blocks = np.zeros((groups, V_GROUP, n, size), dtype=np.uint8)
    body = raw[:, : n * per_block].reshape(groups, n, per_block)
    quants = body[..., : V_GROUP * count].reshape(groups, n, count // 4, V_GROUP, 4).transpose(0, 3, 1, 2, 4)
    blocks[..., first : first + count] = quants.reshape(groups, V_GROUP, n, count)
    if q5:
        spread = np.ascontiguousarray(body[..., V_GROUP * count :]).view(np.uint32)  # [g, blocks, 16]
        qh = _spread_qh(spread, inverse=True).transpose(0, 2, 1)  # [g, 16, blocks]
        blocks[..., first - 4 : first] = np.ascontiguousarray(qh)[..., None].view(np.uint8)
    start = n * per_block
    for i, s in enumerate(scales):
        at = start + n * V_GROUP * 2 * i
        blocks[..., s : s + 2] = raw[:, at : at + n * V_GROUP * 2].reshape(groups, n, V_GROUP, 2).transpose(0, 2, 1, 3)
    return torch.from_numpy(blocks.reshape(groups * V_GROUP, -1)[:out].copy())


def kernel_id(qtype: str) -> int:
    """The kernel's id of a GGUF block type in the file's layout (its GGML type id)."""
    return K_BLOCKS[qtype][1] if qtype in K_BLOCKS else GGML_BLOCKS[qtype][1]


def row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one row of `in_features` weights of a GGUF block type as the file stores it."""
    if qtype in K_BLOCKS:
        return in_features // SUPER_BLOCK * K_BLOCKS[qtype][0]
    return in_features // BLOCK * GGML_BLOCKS[qtype][0]


def _or_empty(scales: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(0) if scales is None else scales


def dequantize_reference(qtype: str, data: torch.Tensor, in_features: int,
                         scales: torch.Tensor | None = None) -> torch.Tensor:
    """[n, row_bytes] uint8 -> [n, in] float32 in torch ops, the same formulas as gguf-py's (and the kernel's); the
    5-bit and K-quant types through gguf-py's own dequantization (the kernel's values are tested equal to it)."""
    n = data.shape[0]
    if qtype == INT8[0]:
        return scales[:, None] * data.view(torch.int8).float()
    if qtype in ("Q5_0", "Q5_1") or qtype in K_BLOCKS:
        import gguf

        values = gguf.quants.dequantize(data.contiguous().numpy(), gguf.GGMLQuantizationType[qtype])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(n, in_features)
    size = GGML_BLOCKS[qtype][0]
    blocks = data.reshape(n, -1, size)  # [n, blocks, bytes]
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    if qtype == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()  # [n, blocks, 32]
        return (q * d).reshape(n, in_features)
    nibbles = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]  # [n, blocks, 16]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()  # [n, blocks, 32]
    if qtype == "Q4_0":
        return (d * (q - 8)).reshape(n, in_features)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()  # [n, blocks, 1]
    return (d * q + m).reshape(n, in_features)


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """[out, in] float -> per-output-channel symmetric int8 (a different model than the original: weights rounded
    to 255 levels per channel)."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127  # [out]
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return QuantWeight(INT8[0], q.view(torch.uint8), weight.shape[1], scales.contiguous())


def quantize_gguf(weight: torch.Tensor, qtype: str, activations: str = "fp32") -> QuantWeight:
    """[out, in] float -> GGUF blocks of qtype, as llama.cpp's converter makes them (gguf-py's `quantize`)."""
    import gguf
    import numpy as np

    blocks = gguf.quants.quantize(weight.float().numpy(), gguf.GGMLQuantizationType[qtype])  # [out, row_bytes]
    return QuantWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), weight.shape[1], activations=activations)


def quantize_linears(weights: dict[str, torch.Tensor], qtype: str,
                     activations: str = "fp32") -> dict[str, torch.Tensor | QuantWeight]:
    """A checkpoint's linear weights (every `*_proj.weight` and the LM head) quantized: qtype "int8" per output
    channel, or a GGUF block type; embeddings, norms and biases stay as they are."""
    def quantize(weight: torch.Tensor) -> QuantWeight:
        return quantize_int8(weight) if qtype == "int8" else quantize_gguf(weight, qtype, activations)

    return {name: quantize(w) if name.endswith("_proj.weight") or name == "lm_head.weight" else w
            for name, w in weights.items()}
