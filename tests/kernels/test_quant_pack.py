"""The integer-activation layouts' repacks in C++ (quant_pack.h: `pack_v` / `unpack_v` of every GGUF block type the
layouts take) give exactly the numpy references' bytes (quant.py `pack_v_reference` / `unpack_v_reference`, quant_vk.py
`pack_vk_reference` / `unpack_vk_reference`), give the file's bytes back, and a weight fused at load (q/k/v,
gate/up) is packed once, from the file's blocks. Blocks are random bytes: the repacks move bytes and bits whatever they
hold, so every bit pattern is a case."""

import numpy as np
import pytest
import torch

from kquant_reference import random_blocks
from verispec.runtime.kernels import quant, quant_vk
from verispec.runtime.kernels.quant import K_BLOCKS, V_LAYOUTS, QuantWeight, kernel, kernel_id, row_bytes

TYPES = list(V_LAYOUTS)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
# [out, in]: a last group short of 16 channels (37 = 2 * 16 + 5; 1: one channel, 15 padded), and the shapes of
# Qwen2.5-Coder-1.5B's linears (q / o 1536, k / v 256, gate / up 8960 out of 1536 in; down 1536 out of 8960 in).
SMALL = [(1, 256), (37, 512)]
REAL = [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)]


def blocks(qtype: str, out: int, width: int, seed: int = 0) -> torch.Tensor:
    """[out, row_bytes] random bytes as blocks of qtype."""
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (out, row_bytes(qtype, width)), np.uint8))


def reference_pack(data: torch.Tensor, qtype: str) -> torch.Tensor:
    return quant_vk.pack_vk_reference(data, qtype) if qtype in K_BLOCKS else quant.pack_v_reference(data, qtype)


def reference_unpack(packed: torch.Tensor, qtype: str, out: int) -> torch.Tensor:
    if qtype in K_BLOCKS:
        return quant_vk.unpack_vk_reference(packed, qtype, out)
    return quant.unpack_v_reference(packed, qtype, out)


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("shape", SMALL + REAL, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", TYPES)
def test_the_cpp_repacks_give_the_numpy_bytes(qtype, shape):
    out, width = shape
    ext, data = kernel(), blocks(qtype, out, width)
    packed = ext.pack_v(data, kernel_id(qtype))  # [ceil(out / 16), 16 * ...]
    assert torch.equal(packed, reference_pack(data, qtype))
    assert torch.equal(ext.unpack_v(packed, kernel_id(qtype), out), data)  # the round trip
    # unpack of bytes no pack made (padding channels included): the reference's formulas, bit for bit
    noise = torch.from_numpy(np.random.default_rng(1).integers(0, 256, tuple(packed.shape), np.uint8))
    assert torch.equal(ext.unpack_v(noise, kernel_id(qtype), out), reference_unpack(noise, qtype, out))


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("qtype", TYPES)
def test_pack_v_and_unpack_v_run_the_cpp(qtype, monkeypatch):
    """The public functions take the C++ path where the kernel is built (the references would raise here), and a
    non-contiguous view packs as its contiguous copy."""
    def refuse(*args):
        raise AssertionError("the numpy reference ran")

    for module, name in [(quant, "pack_v_reference"), (quant, "unpack_v_reference"), (quant_vk, "pack_vk_reference"),
                         (quant_vk, "unpack_vk_reference")]:
        monkeypatch.setattr(module, name, refuse)
    data = blocks(qtype, 64, 512)[::2]  # [32, row_bytes], every other row
    packed = quant.pack_v(data, qtype)
    assert torch.equal(quant.unpack_v(packed, qtype, data.shape[0]), data)


def test_the_comparison_sees_a_swapped_field(monkeypatch):
    """Negative controls: a reference with two fields swapped (Q4_1's d and m; two of Q6_K's high-bit places) no
    longer equals the C++ bytes."""
    if kernel() is None:
        pytest.skip("the quant kernel is not built here")
    data = blocks("Q4_1", 37, 512)
    first, count, scales = quant._v_fields("Q4_1")
    monkeypatch.setattr(quant, "_v_fields", lambda qtype: (first, count, scales[::-1]))
    assert not torch.equal(quant.pack_v_reference(data, "Q4_1"), kernel().pack_v(data, kernel_id("Q4_1")))
    data = blocks("Q6_K", 37, 512)
    places = list(quant_vk._Q6_PLACES)
    places[0], places[1] = places[1], places[0]
    monkeypatch.setattr(quant_vk, "_Q6_PLACES", places)
    assert not torch.equal(quant_vk.pack_vk_reference(data, "Q6_K"), kernel().pack_v(data, kernel_id("Q6_K")))


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
def test_a_weight_fused_at_load_is_packed_once_from_the_files_blocks(qtype, monkeypatch):
    """`cat` of weights not used yet stacks their file bytes (no unpack) and packs the stack once; its bytes equal the
    reference's packing of the stacked blocks, and each part, read later, packs its own blocks."""
    calls = []
    pack_v = quant.pack_v
    monkeypatch.setattr(quant, "pack_v", lambda data, qt, into=None: calls.append(data.shape[0]) or pack_v(data, qt, into))
    monkeypatch.setattr(quant, "unpack_v", lambda *args: pytest.fail("unpacked a weight to fuse it"))
    parts = [blocks(qtype, out, 512, seed) for seed, out in enumerate((48, 16, 16))]
    weights = [QuantWeight(qtype, p, 512, activations="q8") for p in parts]
    fused = torch.cat(weights)
    assert calls == []  # nothing packed until used
    assert torch.equal(fused.data, torch.cat(parts))
    assert torch.equal(fused.packed, reference_pack(torch.cat(parts), qtype)) and calls == [80]
    assert fused.packed is fused.packed and calls == [80]  # once
    assert torch.equal(weights[1].packed, reference_pack(parts[1], qtype)) and calls == [80, 16]


@pytest.mark.kernel("quant")
def test_a_packed_weight_fuses_and_computes_as_before():
    """Weights already packed fuse through their file bytes (unpacked by the C++), and the fused weight's outputs equal
    its parts' outputs bit for bit, whether its parts were packed before `cat` or not."""
    parts = [torch.from_numpy(random_blocks("Q4_K", out, 512, seed)) for seed, out in enumerate((40, 24))]  # finite
    x = torch.randn(3, 512)
    used = [QuantWeight("Q4_K", p, 512, activations="q8") for p in parts]
    each = torch.cat([w.linear(x, None) for w in used], dim=1)  # packs each part
    fresh = torch.cat([QuantWeight("Q4_K", p, 512, activations="q8") for p in parts])
    assert torch.equal(torch.cat(used).packed, fresh.packed)
    assert torch.equal(fresh.linear(x, None), each)


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_blocks_read_when_needed_are_packed_straight_into_their_place(qtype):
    """A weight of `Deferred` blocks (how a GGUF file's are read: nothing until used) reads them once, through the
    mapped path where it has one, and packs them into the given view: the same bytes as packing them in memory; a
    view of the wrong shape is refused."""
    from contextlib import contextmanager

    data = blocks(qtype, 40, 512, 3)
    reads = []

    @contextmanager
    def mapped():
        reads.append("mapped")
        yield data

    weight = QuantWeight(qtype, quant.Deferred(data.shape, lambda: reads.append("copy") or data.clone(), mapped), 512,
                         activations="q8")
    shape, dtype = weight.packed_spec()
    assert reads == [] and dtype == torch.uint8
    view = torch.full(shape, 7, dtype=torch.uint8)
    weight.pack_into(view)
    assert reads == ["mapped"] and weight.packed is view and torch.equal(view, reference_pack(data, qtype))
    with pytest.raises(RuntimeError, match="into"):
        quant.pack_v(data, qtype, into=torch.empty(shape[0], shape[1] + 1, dtype=torch.uint8))
