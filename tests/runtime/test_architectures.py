"""The architecture table (runtime/model/architectures.py): a tiny GGUF file of each Llama-family record, written as
llama.cpp writes it (gguf_writer.py), runs natively on its own blocks with the logits of transformers' fp32
conversion of the same file; the wrong q/k permutation (the Qwen2 bug: rows un-permuted as if the file were a
Llama's) fails that check; what the table does not know is refused by name, never run on a guessed layout.
Gemma 3's file: tests/runtime/test_gemma.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from verispec.runtime.model import architectures
from verispec.runtime.model.architectures import LLAMA, QWEN2, Unknown
from verispec.runtime.runners.native import NativeRunner

from gguf_writer import converted, write_gguf

pytestmark = pytest.mark.kernel("quant")

ATOL = 1e-4
VOCAB = 96
SEQ = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(5)).tolist()


def tiny(arch, seed: int = 3):
    """A tiny model of the record's family: 4 heads over 2 KV heads (GQA), head dim 16; Qwen2 with its q/k/v
    biases and a separate LM head."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, initializer_range=0.15,
                 eos_token_id=2)
    if arch is QWEN2:
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
        with torch.no_grad():  # the biases start at zero: make them count
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        return model.eval()
    return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})).eval()


def native_logits(path, tokens=SEQ, activations: str = "fp32") -> torch.Tensor:
    from verispec.runtime.model.native_lm import from_gguf

    runner = NativeRunner.from_hf(from_gguf(path, activations=activations), 64, 1)
    prefill = runner.forward(torch.tensor([tokens[:8]])).logits[0]  # [8, vocab]
    steps = [runner.forward(torch.tensor([[t]])).logits[0, -1] for t in tokens[8:]]
    return torch.cat([prefill, torch.stack(steps)])


def reference(path, tokens=SEQ) -> torch.Tensor:
    with torch.no_grad():
        return converted(path)(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("arch", [LLAMA, QWEN2], ids=lambda a: a.name)
def test_a_gguf_file_runs_on_its_blocks_as_the_fp32_conversion(arch, tmp_path):
    path = write_gguf(tiny(arch), tmp_path / f"tiny-{arch.name}.gguf", arch)
    torch.testing.assert_close(native_logits(path), reference(path), atol=ATOL, rtol=0)


def test_qwen2s_separate_head_and_biases_are_read(tmp_path):
    from verispec.runtime.model.native_lm import from_gguf

    path = write_gguf(tiny(QWEN2), tmp_path / "tiny-qwen2.gguf", QWEN2)
    model = from_gguf(path)
    assert model.config.model_type == "qwen2" and not model.config.tie_word_embeddings
    native = NativeRunner.from_hf(model, 64, 1).model
    assert native.spec.qkv_bias and native.layers[0].qkv.bias is not None
    assert native.lm_head.weight is not native.embed


@pytest.mark.parametrize("arch", [LLAMA, QWEN2], ids=lambda a: a.name)
def test_the_check_fails_on_the_wrong_permutation(arch, tmp_path, monkeypatch):
    """Negative control: the record's permutation flag flipped (a Qwen2 file un-permuted as a Llama's, the bug this
    table fixed, or a Llama file left permuted) gives logits far from the conversion's."""
    path = write_gguf(tiny(arch), tmp_path / f"tiny-{arch.name}.gguf", arch)
    wrong = dataclasses.replace(arch, permuted_qk=not arch.permuted_qk)
    monkeypatch.setitem(architectures.ARCHITECTURES, arch.name, wrong)
    assert (native_logits(path) - reference(path)).abs().max() > 100 * ATOL


def test_integer_activations_stay_close_to_the_conversion(tmp_path):
    """q8 activations are another model (activations rounded to int8 per block): close, not equal."""
    path = write_gguf(tiny(QWEN2), tmp_path / "tiny-qwen2.gguf", QWEN2)
    q8, ref = native_logits(path, activations="q8"), reference(path)
    assert (q8 - ref).abs().max() < 0.1 * ref.abs().max()


def unknown_file(tmp_path, change) -> object:
    """A tiny Qwen2 file with one thing the table does not know."""
    import gguf

    path = write_gguf(tiny(QWEN2), tmp_path / "tiny-qwen2.gguf", QWEN2)
    reader = gguf.GGUFReader(str(path))
    out = tmp_path / "changed.gguf"
    arch = change.get("arch", "qwen2")
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        value = field.contents()
        name = field.name.replace("qwen2.", f"{arch}.", 1)
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, value)
        elif kind == gguf.GGUFValueType.FLOAT32:
            writer.add_float32(name, value)
        else:
            writer.add_uint32(name, value)
    for key, value in change.get("keys", {}).items():
        writer.add_string(key, value)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    for name, value in change.get("tensors", {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("change, named", [
    ({"arch": "qwen3"}, "architecture 'qwen3'"),
    ({"keys": {"qwen2.rope.scaling.type": "yarn"}}, "'qwen2.rope.scaling.type'"),
    ({"tensors": {"rope_freqs.weight": torch.ones(8).numpy()}}, "'rope_freqs.weight'"),
], ids=["architecture", "metadata-key", "tensor"])
def test_what_the_table_does_not_know_is_refused_by_name(change, named, tmp_path):
    from verispec.runtime.model.native_lm import from_gguf
    from verispec.runtime.model.target import load_target, resolve_weights

    path = unknown_file(tmp_path, change)
    with pytest.raises(Unknown, match=named):
        from_gguf(path)
    weights, why = resolve_weights("auto", path)
    assert weights == "fp32" and named in why
    with pytest.raises(Unknown, match=named):  # its blocks asked for by name: a clear error
        load_target(path, weights="gguf", activations="fp32")
    if "arch" not in change:  # 'auto' sends it to transformers' conversion (the reason above is logged)
        assert not hasattr(load_target(path, weights=weights), "hf_model")  # Hugging Face's model, not ours


def test_the_unchanged_file_passes_the_same_rewrite(tmp_path):
    """The rewrite above changes nothing by itself (so the refusals are the change's)."""
    from verispec.runtime.model.native_lm import from_gguf

    assert from_gguf(unknown_file(tmp_path, {})).config.model_type == "qwen2"
