"""Integer activations on the GGUF block types (quant_q8.h, `QuantWeight(..., activations="q8")`): the V layouts keep
the file's bytes, every kernel path gives the same bits, a row's outputs do not depend on the rows beside it or the
thread count, and the arithmetic is the stated one (checked against a float64 reference of it, with a negative
control that the check catches an activation rounding off by one rule)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import machine_reason
from verispec.runtime.kernels import pool
from verispec.runtime.kernels.quant import (K_BLOCKS, PATHS, V_LAYOUTS, QuantWeight, kernel, pack_v, quantize_gguf,
                                            unpack_v)

TYPES = sorted(set(V_LAYOUTS) - set(K_BLOCKS))  # blocks of 32 (the K-quants' integer path: test_quant_vk.py)
SHAPES = [(37, 64), (100, 576), (16, 1536)]  # out not a multiple of 16, the embedded model's widths


def paths_here() -> list[int]:
    ext = kernel()
    out = []
    for name in ("scalar", "avx2", "avx512"):
        try:
            out.append(ext.resolve_path(PATHS[name]))
        except RuntimeError:
            continue
    return sorted(set(out))


def weight(qtype: str, out: int, inn: int, seed: int = 0) -> QuantWeight:
    torch.manual_seed(seed)
    return quantize_gguf(torch.randn(out, inn), qtype, activations="q8")


def reference(x: torch.Tensor, w: QuantWeight, rounding=torch.round) -> torch.Tensor:
    """The stated arithmetic in float64 (isum exact; each fp32 rounding of the kernel applied where it rounds, the fma
    emulated as an exact product plus one rounding, which may differ from a true fma in the last bit)."""
    blocks = np.frombuffer(w.data.numpy().tobytes(), dtype=np.uint8).reshape(w.shape[0], -1)
    out, inn = w.shape
    nb = inn // 32
    size = blocks.shape[1] // nb
    b = blocks.reshape(out, nb, size)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [out, nb]
    if w.qtype == "Q8_0":
        k = b[..., 2:].view(np.int8).astype(np.int64)  # [out, nb, 32]
    else:
        q = b[..., size - 16 :]
        k = np.concatenate([q & 0x0F, q >> 4], axis=-1).astype(np.int64)
        if w.qtype in ("Q5_0", "Q5_1"):  # the fifth bits: qh bit j is element j's
            qh = b[..., size - 20 : size - 16].copy().view(np.uint32)  # [out, nb, 1]
            k = k + (((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64) << 4)
        k = k - {"Q4_0": 8, "Q5_0": 16}.get(w.qtype, 0)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if w.qtype in ("Q4_1", "Q5_1") else None
    xb = x.view(x.shape[0], nb, 32)
    dx = (xb.abs().amax(-1) / 127).float()  # [rows, nb]
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    xq = rounding(xb * inv.unsqueeze(-1)).to(torch.int64)  # [rows, nb, 32]
    isum = torch.einsum("rbj,obj->rob", xq, torch.from_numpy(k))  # [rows, out, nb], exact
    sx = (dx * xq.sum(-1).float()).float()  # [rows, nb]
    acc = torch.zeros(x.shape[0], out, dtype=torch.float32)
    for j in range(nb):
        t = (torch.from_numpy(d[:, j]).unsqueeze(0) * dx[:, j : j + 1]).float()  # [rows, out] dw * dx
        acc = (t.double() * isum[:, :, j].double() + acc.double()).float()
        if m is not None:
            acc = (torch.from_numpy(m[:, j]).double().unsqueeze(0) * sx[:, j : j + 1].double() + acc.double()).float()
    return acc


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("qtype", TYPES)
def test_the_v_layout_keeps_the_files_bytes_and_values(qtype):
    for out, inn in SHAPES:
        w = weight(qtype, out, inn)
        plain = quantize_gguf(w.dequantize(), qtype)  # the file layout of the same values
        assert torch.equal(unpack_v(pack_v(w.data, qtype), qtype, out), w.data)
        assert torch.equal(w.dequantize(), plain.dequantize())
        ids = torch.tensor([0, out - 1, out // 2])
        assert torch.equal(F.embedding(ids, w), plain.dequantize()[ids])


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("qtype", TYPES)
def test_every_path_gives_the_same_bits_in_any_batch(qtype):
    paths = paths_here()
    if len(paths) < 2:
        pytest.skip(machine_reason("one kernel path runs on this CPU"))
    for out, inn in SHAPES:
        w = weight(qtype, out, inn)
        x = torch.randn(40, inn)
        x[3] = 0.0  # a zero block: dx = 0, q = 0
        x[5, :32] *= 1e-30  # tiny values: their own scale
        full = {p: w.linear(x, None, path=p) for p in paths}
        for p in paths[1:]:
            assert torch.equal(full[p], full[paths[0]]), (p, qtype, out, inn)
        for p in paths:
            for rows in (1, 2, 5, 17):  # each row as in the batch of 40, alone or beside others
                assert torch.equal(w.linear(x[:rows], None, path=p), full[p][:rows])
            assert torch.equal(w.linear(x[7:8], None, path=p), full[p][7:8])


@pytest.mark.kernel("quant")
def test_the_avx2_tiles_maddubs_and_vpdpbusd_give_the_same_bits():
    """The 256-bit tile computes its products with vpdpbusd where the build has it (AVX-VNNI, or AVX-512 VNNI + VL
    as on this CPU's own build) and with maddubs + madd elsewhere: the kernel built as for a CPU without AVX-512
    (maddubs) against this build's AVX2 and best paths, every V type, 1 to 40 rows."""
    import platform

    from verispec.runtime.kernels.ext import REQUIRE_ENV, VARIANTS, build

    if "quant_avx2" not in VARIANTS:
        pytest.skip(machine_reason(f"-mno-avx512f is an x86 flag; this CPU is {platform.machine()}"))
    if PATHS["avx2"] not in paths_here():
        pytest.skip(machine_reason("this CPU has no AVX2 + FMA + F16C"))
    avx2 = build("quant_avx2", *VARIANTS["quant_avx2"])  # built by make test; raises under VERISPEC_REQUIRE_KERNELS=1
    if avx2 is None:
        pytest.skip(f"the kernel could not be built without AVX-512 here; {REQUIRE_ENV}=1 makes this an error")
    for qtype in TYPES:
        for out, inn in SHAPES:
            w = weight(qtype, out, inn)
            x = torch.randn(40, inn)
            for rows in (1, 5, 40):
                args = (x[:rows], w.packed, w._scales_arg, w.kernel_id, inn, out)
                want = kernel().quant_linear(*args, PATHS["avx2"])
                assert torch.equal(avx2.quant_linear(*args, PATHS["avx2"]), want), (qtype, out, inn, rows)
                assert torch.equal(kernel().quant_linear(*args, PATHS["auto"]), want)


@pytest.mark.kernel("quant")
def test_the_thread_count_changes_no_bit():
    w = weight("Q4_1", 100, 576)
    x = torch.randn(9, 576)
    threads = pool.threads()
    try:
        pool.set_threads(1)
        one = w.linear(x, None)
        pool.set_threads(2)
        assert torch.equal(w.linear(x, None), one)
    finally:
        pool.set_threads(threads)


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("qtype", TYPES)
def test_the_arithmetic_is_the_stated_one(qtype):
    out, inn = 100, 576
    w = weight(qtype, out, inn)
    x = torch.randn(6, inn) * 3
    y = w.linear(x, None)
    scale = y.abs().max()
    assert (y - reference(x, w)).abs().max() <= 1e-6 * scale
    # Negative control: the same check with activations rounded down instead of to nearest is far off.
    assert (y - reference(x, w, rounding=torch.floor)).abs().max() > 1e-3 * scale
    # And it is another model than the fp32 activations, close to it (the 8-bit activations' error).
    fp32 = x @ w.dequantize().T
    assert 0 < (y - fp32).abs().max() <= 0.05 * fp32.abs().max()


def test_integer_activations_refuse_types_they_do_not_run():
    with pytest.raises(ValueError, match="integer activations"):
        QuantWeight("INT8", torch.zeros(4, 32, dtype=torch.uint8), 32, torch.ones(4), activations="q8")
    with pytest.raises(ValueError, match="choose from"):
        QuantWeight("Q8_0", torch.zeros(4, 34, dtype=torch.uint8), 32, activations="int4")


# -- the engine on integer activations: exact speculation, batch invariance ------------------------------------------


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_speculation_and_batches_on_integer_activations_equal_the_target_alone(qtype, trained_pair, tokenizer):
    """The verify pass (K + 1 rows) is bit for bit the one-token step on the q8 path, so speculation with a draft
    model and n-gram drafts, greedy and coupled seeded sampling, equals the target alone, alone and in a batch."""
    import copy

    from verispec.config import RunnerOptions, SamplingParams
    from verispec.drafters.build import model_drafter
    from verispec.drafters.ngram import NgramDrafter
    from verispec.engine import SpeculativeEngine
    from verispec.runtime.model.twins import use_quantized_weights

    target, draft = trained_pair
    quantized = copy.deepcopy(target)
    twin = use_quantized_weights(quantized, 128, quantization=qtype, activations="q8")
    assert twin.layers[0].qkv.weight.activations == "q8" and twin.lm_head.weight.activations == "q8"
    options = RunnerOptions(compile=False)
    prompts = [tokenizer(t)["input_ids"] for t in ("the dog sat", "Paris is the capital", "one", "the cat sat on")]
    for params in (SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=20, temperature=1.0, seed=7,
                                                                      coupled=True)):
        alone = [SpeculativeEngine(quantized, tokenizer, max_len=128, runner=options, max_batch_size=1)
                 .generate(p, params, use_drafter=False).token_ids for p in prompts]
        for drafter in (model_drafter(quantized, draft, 200), NgramDrafter()):
            engine = SpeculativeEngine(quantized, tokenizer, drafter, max_len=128, runner=options)
            assert [r.token_ids for r in engine.generate_batch(prompts, params)] == alone


@pytest.mark.kernel("quant")
def test_integer_activations_are_another_model_close_to_the_fp32_one(trained_pair, tokenizer):
    """Not the fp32 conversion's values (a test that q8 really ran), but close to them: logits within a few percent
    of their range on a tiny trained model."""
    import copy

    from verispec.runtime.runners.native import NativeRunner

    from verispec.runtime.model.twins import use_quantized_weights

    target, _ = trained_pair
    logits = {}
    for activations in ("fp32", "q8"):
        model = copy.deepcopy(target)
        twin = use_quantized_weights(model, 64, quantization="Q4_1", activations=activations)
        tokens = torch.tensor([tokenizer("the dog sat on the mat")["input_ids"]])
        logits[activations] = NativeRunner(twin, model.config, 64).forward(tokens).logits
    span = logits["fp32"].max() - logits["fp32"].min()
    difference = (logits["q8"] - logits["fp32"]).abs().max()
    assert 0 < difference < 0.05 * span
