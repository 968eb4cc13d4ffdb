"""Models loaded without Hugging Face modeling (runtime/model/native_lm.py): a plain Llama folder as a
`NativeCausalLM` (how drafts load) runs exactly as the Hugging Face model of the same folder, on either runner."""

from __future__ import annotations

import torch

from verispec.config import RunnerOptions
from verispec.runtime.model.llama import LlamaSpec
from verispec.runtime.model.loading import load_draft, load_model, read_model_config
from verispec.runtime.model.native_lm import NativeCausalLM, NativeLlamaConfig, folder_config, from_folder
from verispec.runtime.runners.select import make_runner

from conftest import tiny_qwen2

IDS = torch.tensor([[1, 7, 9, 12, 30, 5, 44]])


def logits(model, backend: str) -> torch.Tensor:
    return make_runner(model, 64, 1, RunnerOptions(backend=backend)).forward(IDS).logits  # [1, n, vocab]


def test_a_plain_llama_folder_loads_without_hf_modeling_and_runs_as_the_hf_model(model_dirs):
    folder = model_dirs["draft"]
    native, hf = from_folder(folder, torch.float32), load_model(folder, dtype=torch.float32)
    assert isinstance(native, NativeCausalLM) and isinstance(load_draft(folder, torch.float32), NativeCausalLM)
    assert dict(native.named_parameters()).keys() == dict(hf.named_parameters()).keys()
    assert all(torch.equal(p, dict(hf.named_parameters())[n]) for n, p in native.named_parameters())
    assert native.get_output_embeddings().weight.shape == hf.get_output_embeddings().weight.shape
    assert native.generation_config.eos_token_id == hf.generation_config.eos_token_id
    assert torch.equal(logits(native, "native"), logits(hf, "native"))  # the same twin, from the same tensors
    assert torch.equal(logits(native, "hf"), logits(hf, "hf"))  # Hugging Face modeling on the same weights


def test_its_config_is_read_without_transformers_model_families(model_dirs):
    folder = model_dirs["target"]
    config = read_model_config(folder)
    assert isinstance(config, NativeLlamaConfig)
    assert LlamaSpec.from_config(config, 64) == LlamaSpec.from_config(load_model(folder).config, 64)


def test_other_folders_load_with_hugging_face(tmp_path):
    tiny_qwen2(3).save_pretrained(tmp_path)
    assert folder_config(tmp_path) is None and from_folder(tmp_path, torch.float32) is None
    assert not isinstance(load_draft(tmp_path, torch.float32), NativeCausalLM)
    assert read_model_config(tmp_path).model_type == "qwen2"


def test_a_draft_saved_with_its_targets_tokenizer_files_shares_the_tokenizer_object(model_dirs, tmp_path):
    from verispec.drafters.build import _draft_tokenizer
    from verispec.runtime.model.loading import load_tokenizer
    from verispec.runtime.model.tokenizer_cache import saved_alike

    target = load_tokenizer(model_dirs["target"])
    assert saved_alike(model_dirs["draft"], target) and _draft_tokenizer(str(model_dirs["draft"]), target) is target
    other = tmp_path / "other"
    other.mkdir()
    target.save_pretrained(other)
    (other / "config.json").write_bytes((model_dirs["draft"] / "config.json").read_bytes())
    (other / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")  # another template: not the same
    assert not saved_alike(other, target)
    loaded = _draft_tokenizer(str(other), target)
    assert loaded is not None and loaded is not target and loaded.get_vocab() == target.get_vocab()
