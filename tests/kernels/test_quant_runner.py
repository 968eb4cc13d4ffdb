"""Quantized weights on the native runner: the C++ kernel's values and rows, and a tiny model with quantized
weights end to end (greedy speculative output equals its own target alone)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import machine_reason, tiny_llama
from test_quant_values import random_blocks  # tests/kernels' helper
from verispec.runtime.kernels import pool
from verispec.config import RunnerOptions, SamplingParams
from verispec.engine import SpeculativeEngine
from verispec.runtime.model.llama import LlamaModel
from verispec.runtime.kernels import quant
from verispec.runtime.runners.native import NativeRunner
from verispec.runtime.model.twins import use_quantized_weights
from verispec.runtime.kernels.quant import GGML_BLOCKS, PATHS, QuantWeight, dequantize_reference, kernel, quantize_int8

QTYPES = sorted(GGML_BLOCKS) + ["int8"]


def weight_of(qtype: str, out: int = 40, width: int = 96) -> QuantWeight:
    if qtype == "int8":
        return quantize_int8(torch.randn(out, width))
    return QuantWeight(qtype, torch.from_numpy(random_blocks(qtype, out, width)), width)


def available_paths() -> list[str]:
    """The kernel paths this build and CPU run (scalar always; avx2, avx512 where the CPU has them)."""
    ext = kernel()
    paths = ["scalar"]
    for name in ("avx2", "avx512"):
        try:
            ext.resolve_path(PATHS[name])
            paths.append(name)
        except RuntimeError:
            pass
    return paths


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_kernel_values_and_row_invariance(qtype, path):
    """On every kernel path: the dequantized values are the reference's bit for bit; a row's output does not depend
    on the rows beside it (1 to 40 rows: past every tile size, the 11- and 16-row GEMM and panel switches and channel
    tails)
    nor on the thread count, and equals x @ W^T in float64 within float32 summation error."""
    if path not in available_paths():
        pytest.skip(machine_reason(f"the {path} path does not run on this CPU"))
    torch.manual_seed(0)
    w = weight_of(qtype, out=43)  # 43: not a multiple of any tile's channel count
    reference = dequantize_reference(w.qtype, w.data, w.shape[1], w.scales)  # [out, in]
    assert torch.equal(w.dequantize(), reference)
    x = torch.randn(40, w.shape[1])
    threads = pool.threads()
    try:
        pool.set_threads(1)
        alone = torch.cat([w.linear(x[i : i + 1], None, PATHS[path]) for i in range(40)])  # [40, out]
        for n in (1, 2):
            pool.set_threads(n)
            for rows in range(1, 41):
                assert torch.equal(w.linear(x[:rows], None, PATHS[path]), alone[:rows]), (rows, n)
    finally:
        pool.set_threads(threads)
    exact = x.double() @ reference.double().T
    torch.testing.assert_close(alone.double(), exact, atol=1e-4, rtol=1e-5)
    assert not torch.equal(alone, torch.zeros_like(alone))


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "int8"])
@pytest.mark.parametrize("width", [576, 1536])  # the embedded target's inputs: 8- and 4-channel AVX-512 panels
def test_many_rows_give_each_row_its_one_row_bits(qtype, width, path):
    """The many-row paths (AVX-512's GEMM from 11 rows, AVX2's panel from 16) and the tiles of up to 5 rows before
    them at the model's input widths: rows just below and above each switch, uneven tiles of rows, a verify pass at
    batch 16 (80) and a prefill chunk (130), on 1 and 2 threads; 203 channels: a partial last group and several
    panels per thread."""
    if path not in available_paths():
        pytest.skip(machine_reason(f"the {path} path does not run on this CPU"))
    torch.manual_seed(1)
    w = weight_of(qtype, out=203, width=width)
    x = torch.randn(130, width)
    threads = pool.threads()
    try:
        pool.set_threads(1)
        alone = torch.cat([w.linear(x[i : i + 1], None, PATHS[path]) for i in range(130)])  # [130, out]
        for n in (1, 2):
            pool.set_threads(n)
            for rows in (*range(2, 14), 15, 16, 17, 80, 130):
                assert torch.equal(w.linear(x[:rows], None, PATHS[path]), alone[:rows]), (rows, n)
    finally:
        pool.set_threads(threads)
    reference = dequantize_reference(w.qtype, w.data, width, w.scales).double()  # [out, in]
    bound = 1e-5 * (x.double().abs() @ reference.abs().T)  # float32 summation error, far above its real size
    assert ((alone.double() - x.double() @ reference.T).abs() <= bound).all()


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_kernels_own_dequantized_values_are_gguf_pys(qtype, path):
    """x = the identity picks each weight out of the sums exactly (the other products are zeros), so this sees the
    values the kernel dequantizes in its registers (tiles: 5 rows a call) and in its prefill panels (96 rows)."""
    if path not in available_paths():
        pytest.skip(machine_reason(f"the {path} path does not run on this CPU"))
    w = weight_of(qtype, out=43)
    reference = dequantize_reference(w.qtype, w.data, w.shape[1], w.scales)  # [out, in]
    eye = torch.eye(w.shape[1])  # [in, in]
    assert torch.equal(w.linear(eye, None, PATHS[path]), reference.T)  # one call: the panel path
    tiles = torch.cat([w.linear(eye[i : i + 5], None, PATHS[path]) for i in range(0, w.shape[1], 5)])
    assert torch.equal(tiles, reference.T)


@pytest.mark.kernel("quant")
@pytest.mark.parametrize("path", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("qtype", sorted(quant.REPACKED))
@pytest.mark.parametrize("out", [43, 49152])  # 49152 x 576: the embedded target's LM head
def test_the_repacked_layout_computes_what_the_files_layout_does(qtype, out, path):
    """Repacked Q4 blocks (the kernel's load-time layout) give the values and the very sums, in the same order, of
    the file's layout on each path: the file's blocks still run through the kernel (their own type id), so every
    output is compared bit for bit, at the tile sizes (1, 5, 7 rows) and the panel's (16)."""
    if path not in available_paths():
        pytest.skip(machine_reason(f"the {path} path does not run on this CPU"))
    width = 576 if out > 1000 else 96
    torch.manual_seed(2)
    w = QuantWeight(qtype, torch.from_numpy(random_blocks(qtype, out, width, seed=3)), width)
    file_id = GGML_BLOCKS[qtype][1]
    ids = torch.tensor([0, out - 1, out // 2, 5])
    assert torch.equal(w.dequantize(ids), dequantize_reference(qtype, w.data[ids], width))
    for rows in (1, 5, 7, 16):
        x = torch.randn(rows, width)
        ours = w.linear(x, None, PATHS[path])  # [rows, out]
        assert torch.equal(ours, kernel().quant_linear(x, w.data, torch.empty(0), file_id, width, out, PATHS[path]))
        assert torch.equal(ours[-1:], w.linear(x[-1:], None, PATHS[path]))  # row invariance
    if out < 1000:
        assert torch.equal(w.dequantize(), dequantize_reference(qtype, w.data, width))


@pytest.mark.kernel("quant")
def test_the_default_path_is_the_best_the_cpu_runs(monkeypatch):
    if quant.KERNEL_PATH != PATHS["auto"]:
        pytest.skip("VERISPEC_QUANT_PATH forces a path in this run")
    assert kernel().resolve_path(PATHS["auto"]) == PATHS[available_paths()[-1]]
    torch.manual_seed(1)
    w, x = weight_of("Q4_1"), torch.randn(3, 96)
    assert torch.equal(F.linear(x, w), w.linear(x, None, PATHS[available_paths()[-1]]))
    monkeypatch.setenv("VERISPEC_QUANT_PATH", "avx2")
    assert quant._path_from_env() == PATHS["avx2"]
    monkeypatch.setenv("VERISPEC_QUANT_PATH", "sse")
    with pytest.raises(ValueError, match="choose from"):
        quant._path_from_env()


@pytest.mark.kernel("quant")
def test_one_numbering_of_kernel_paths():
    """paths.py's KernelPath is what the quant kernel (quant_common.h's Path) and the dense kernel take, and what
    quant.py and dense.py name; a path number neither kernel has is refused."""
    from verispec.runtime.kernels import dense
    from verispec.runtime.kernels.paths import KernelPath

    assert kernel().path_numbers() == PATHS == {p.name.lower(): int(p) for p in KernelPath if p != KernelPath.VDPBF16PS}
    assert {name: n for name, n in dense.PATHS.items() if n is not None} == {
        p.name.lower(): int(p) for p in KernelPath if p != KernelPath.AUTO}
    assert kernel().resolve_path(KernelPath.SCALAR) == KernelPath.SCALAR
    with pytest.raises(RuntimeError, match="path must be"):
        kernel().resolve_path(KernelPath.VDPBF16PS)


def test_the_kernel_is_built_here():
    """The C++ kernel builds on a machine with a compiler (else the fallback would hide a build error)."""
    assert kernel() is not None


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "int8"])
def test_quantized_target_speculation_equals_its_target_alone(qtype, trained_pair, tokenizer):
    from verispec.drafters.build import model_drafter

    target, draft = trained_pair
    quantized = copy.deepcopy(target)
    twin = use_quantized_weights(quantized, 128, quantization=qtype)
    assert isinstance(twin.layers[0].qkv.weight, QuantWeight) and isinstance(twin.lm_head.weight, QuantWeight)
    prompts = [tokenizer(t)["input_ids"] for t in ("the dog sat", "Paris is the capital", "one")]
    alone_engine = SpeculativeEngine(quantized, tokenizer, max_len=128, runner=RunnerOptions(compile=False))
    assert isinstance(alone_engine.target, NativeRunner) and alone_engine.target.model is twin
    alone = [r.token_ids for r in alone_engine.generate_batch(prompts, SamplingParams(max_new_tokens=24),
                                                               use_drafter=False)]
    engine = SpeculativeEngine(quantized, tokenizer, model_drafter(quantized, draft, 200), max_len=128,
                               runner=RunnerOptions(compile=False))
    spec = engine.generate_batch(prompts, SamplingParams(max_new_tokens=24))
    assert [r.token_ids for r in spec] == alone


def test_quantized_logits_equal_the_dequantized_model_up_to_summation_order():
    model = tiny_llama(5, hidden=64)
    twin = use_quantized_weights(model, 64, quantization="Q4_1")
    dense = LlamaModel(twin.spec, _dense_weights(twin), (twin.cos, twin.sin), pack=False)
    tokens = torch.tensor([[5, 9, 14, 3, 7]])
    ours, theirs = NativeRunner(twin, model.config, 64), NativeRunner(dense, model.config, 64)
    torch.testing.assert_close(ours.forward(tokens).logits, theirs.forward(tokens).logits, atol=1e-4, rtol=0)


def _dense_weights(twin: LlamaModel) -> dict[str, torch.Tensor]:
    """The quantized twin's weights dequantized, by checkpoint name (q/k/v and gate/up split back)."""
    s = twin.spec
    weights = {"model.embed_tokens.weight": twin.embed, "model.norm.weight": twin.norm,
               "lm_head.weight": twin.lm_head.weight.dequantize()}
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    for i, layer in enumerate(twin.layers):
        qkv, gate_up = layer.qkv.weight.dequantize(), layer.gate_up.weight.dequantize()
        parts = {"self_attn.q_proj": qkv[:q], "self_attn.k_proj": qkv[q : q + kv], "self_attn.v_proj": qkv[q + kv :],
                 "self_attn.o_proj": layer.o.weight.dequantize(), "mlp.gate_proj": gate_up[: s.intermediate_size],
                 "mlp.up_proj": gate_up[s.intermediate_size :], "mlp.down_proj": layer.down.weight.dequantize(),
                 "input_layernorm": layer.attn_norm, "post_attention_layernorm": layer.mlp_norm}
        weights |= {f"model.layers.{i}.{k}.weight": v for k, v in parts.items()}
    return weights
