"""Draft auto-selection: name normalisation, the registry, tokenizer-family matching, and `verispec pairs`."""

import json
from pathlib import Path

import pytest

from conftest import VOCAB, tiny_llama
from verispec.drafters import auto as pairs
from verispec.cli import main
from verispec.drafters.build import build_drafter
from verispec.drafters.ngram import NgramDrafter
from verispec.runtime.model.loading import SMOLLM2_DRAFT, SMOLLM2_TARGET
from verispec.drafters.auto import (
    find_family_draft,
    folder_signature,
    local_model_dirs,
    lookup_pair,
    normalize_model_name,
    object_signature,
    select_draft,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("pairs-models")
    built = {"target": tiny_llama(30, hidden=64), "small": tiny_llama(31, layers=1), "tiny": tiny_llama(32, hidden=16,
             layers=1), "odd_vocab": tiny_llama(33, layers=1, vocab=VOCAB + 3)}
    for name, model in built.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


@pytest.fixture
def empty_hub(tmp_path, monkeypatch):
    """No Hugging Face cache and no bundled draft: only what a test puts in search_dirs is local."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    real = pairs.local_path
    monkeypatch.setattr(pairs, "local_path", lambda name: None if name == SMOLLM2_DRAFT else real(name))


@pytest.mark.parametrize("name,key,instruct", [
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b-instruct", True),
    ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b-instruct", True),
    ("Qwen/Qwen2.5-72B", "qwen-2.5-72b", False),
    ("llama3.1_8b", "llama-3.1-8b", False),
    ("/models/DeepSeek-V3/", "deepseek-v3", False),
    ("gemma-2-9b-it.gguf", "gemma-2-9b-it", True),
])
def test_normalize_model_name(name, key, instruct):
    assert normalize_model_name(name) == (key, instruct)


@pytest.mark.parametrize("name,target,k", [
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b", 3),
    ("meta-llama/Llama-3.1-8B", "llama-3.1-8b", 3),
    ("Meta-Llama-3.1-70B-Instruct-AWQ", "llama-3.1-70b", 4),
    ("Qwen/Qwen2.5-72B-Instruct", "qwen-2.5-72b", 4),
    ("deepseek-ai/DeepSeek-V3", "deepseek-v3", 4),
    ("deepseek-ai/DeepSeek-V3-0324", "deepseek-v3", 4),
    (SMOLLM2_TARGET, normalize_model_name(SMOLLM2_TARGET)[0], 4),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", normalize_model_name(SMOLLM2_TARGET)[0], 4),
])
def test_registry_lookup(name, target, k):
    pair = lookup_pair(name)
    assert pair is not None and pair.target == target and pair.num_draft_tokens == k


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-80B", "meta-llama/Llama-3.2-1B", "deepseek-v3.1", "gpt2"])
def test_registry_does_not_match_other_models(name):
    assert lookup_pair(name) is None


def test_default_pair_is_registered():
    assert lookup_pair(SMOLLM2_TARGET).draft == SMOLLM2_DRAFT


def test_registry_draft_used_when_local_instruct_first(monkeypatch):
    available = {"meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.2-1B"}
    monkeypatch.setattr(pairs, "local_path", lambda name: Path("/cache") / name if name in available else None)
    choice = select_draft("meta-llama/Llama-3.1-8B-Instruct")
    assert (choice.draft, choice.num_draft_tokens, choice.source) == ("meta-llama/Llama-3.2-1B-Instruct", 3, "registry")
    assert select_draft("meta-llama/Llama-3.1-8B").draft == "meta-llama/Llama-3.2-1B"


def test_registry_draft_missing_falls_back_to_ngram(empty_hub):
    choice = select_draft("meta-llama/Llama-3.1-8B-Instruct")
    assert choice.draft == "ngram" and choice.source == "ngram" and "not available locally" in choice.reason


def test_family_match_by_tokenizer(folders, empty_hub):
    # target ~84k parameters; 'small' ~14k, 'tiny' ~3k (<= 1/8 of the target: the largest such is preferred)
    choice = select_draft(str(folders / "target"), search_dirs=[folders])
    assert choice.source == "tokenizer" and Path(choice.draft) == folders / "tiny"
    signature = folder_signature(folders / "target")
    assert signature.vocab_size == VOCAB and not signature.compatible(folder_signature(folders / "odd_vocab"))
    # without a size bound (an in-memory target), the smallest compatible model
    assert find_family_draft(signature, None, [folders], exclude=folders / "target") == folders / "tiny"
    # a target of 100k parameters: 'small' (14k) is at most half of it but above 1/8 -> 'tiny' still wins
    only_small = [folders / "small", folders / "odd_vocab"]
    assert find_family_draft(signature, 100_000, only_small) == folders / "small"
    assert find_family_draft(signature, 20_000, only_small) is None  # 'small' is not small enough


def test_object_signature_matches_folder_signature(folders, tokenizer):
    target = tiny_llama(30, hidden=64)
    assert object_signature(target.config, tokenizer).compatible(folder_signature(folders / "target"))


def test_local_model_dirs_reads_the_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert snapshot in local_model_dirs()


def test_auto_drafter_for_an_unknown_in_memory_target(tokenizer, empty_hub):
    drafter = build_drafter("auto", tiny_llama(34), tokenizer, 128).drafter
    assert isinstance(drafter, NgramDrafter)


def test_cli_pairs_table_and_json(capsys):
    assert main(["pairs"]) == 0
    table = capsys.readouterr().out
    assert "llama-3.1-8b" in table and "meta-llama/Llama-3.2-1B" in table and "K" in table.splitlines()[0]
    assert main(["pairs", "--json", "--model", "meta-llama/Llama-3.1-70B-Instruct"]) == 0
    data = json.loads(capsys.readouterr().out)
    targets = {row["target"]: row for row in data["pairs"]}
    assert set(targets) >= {"llama-3.1-70b", "llama-3.1-8b", "qwen-2.5-72b", "deepseek-v3"}
    assert targets["llama-3.1-70b"]["num_draft_tokens"] == 4 and targets["llama-3.1-8b"]["num_draft_tokens"] == 3
    assert data["selection"]["num_draft_tokens"] == 4 and data["selection"]["draft"]
