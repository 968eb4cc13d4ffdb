"""Model loading: tiny models from configs by path, clear errors, and (slow) the embedded default target."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, ViTConfig, ViTModel

from verispec.runtime.model.loading import (
    SMOLLM2_TARGET,
    ModelLoadError,
    load_model,
    load_tokenizer,
    model_weight_bytes,
    resolve_model_path,
)


def _tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


@pytest.fixture
def tiny_llama_dir(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config())
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    return folder, model


def test_tiny_llama_loads_back_by_path(tiny_llama_dir):
    folder, original = tiny_llama_dir
    assert resolve_model_path(str(folder)) == folder
    model = load_model(str(folder), dtype="float32")  # ('auto' may pick bf16 on this CPU)
    assert isinstance(model, LlamaForCausalLM)
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits)


def test_load_model_casts_dtype(tiny_llama_dir):
    folder, original = tiny_llama_dir
    model = load_model(folder, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    n_params = sum(p.numel() for p in original.parameters())  # tied embeddings counted once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # rotary frequencies stay fp32
    assert model_weight_bytes(model) == 2 * n_params + buffers


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_model(str(missing))
    with pytest.raises(ModelLoadError, match="no-such-model"):
        resolve_model_path(f"./{missing.name}")


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


def test_non_causal_lm_is_rejected(tmp_path):
    config = ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                       image_size=8, patch_size=4)
    ViTModel(config).save_pretrained(tmp_path / "vit")
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        load_model(tmp_path / "vit")


def test_uncached_hub_id_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="local Hugging Face cache"):
        resolve_model_path("someone/not-a-cached-model")


def test_plain_file_is_rejected(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="weights.bin"):
        resolve_model_path(path)


@pytest.mark.slow
def test_default_target_answers_greedily():
    model = load_model(SMOLLM2_TARGET)
    tokenizer = load_tokenizer(SMOLLM2_TARGET)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."
