"""The one drafter builder (drafters/build.py): caches sized from the user's max_len in one place, strict and
fallback modes, and the draft head's own slack holding the deepest, widest tree a round can draft."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, draft_batch, tiny_llama
from verispec.config import MAX_DRAFT_TOKENS, MAX_VERIFY_WIDTH, cache_len
from verispec.distill.head import HeadNet
from verispec.drafters import head as head_module
from verispec.drafters.build import build_drafter
from verispec.drafters.cascade import CascadeDrafter
from verispec.drafters.head import TREE_BEAM, HeadConfig, HeadDrafter, save_head
from verispec.drafters.model import ModelDrafter


@pytest.fixture(scope="module")
def target():
    return tiny_llama(40)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("build")
    tiny_llama(41, layers=1).save_pretrained(root / "draft")
    tiny_llama(42, layers=1).save_pretrained(root / "corrupt")
    weights = root / "corrupt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # a valid folder whose weights cannot be read
    config = HeadConfig.for_target(target.config, "tiny", VOCAB)
    save_head(root / "head", config, HeadNet(config, target, torch.arange(VOCAB), seed=0).export(), torch.float32)
    return root


def test_caches_are_sized_from_the_users_max_len(target, tokenizer, folders):
    model = build_drafter(str(folders / "draft"), target, tokenizer, 100).drafter
    assert isinstance(model, ModelDrafter)
    assert model.runner.max_len == cache_len(100) == 100 + MAX_VERIFY_WIDTH
    cascade = build_drafter(f"ngram+head:{folders / 'head'}", target, tokenizer, 100).drafter
    assert isinstance(cascade, CascadeDrafter) and isinstance(cascade.stages[1], HeadDrafter)
    assert cascade.stages[1].max_len == cache_len(100) + head_module.TREE_SLACK


def test_raise_or_fall_back(target, tokenizer, folders):
    with pytest.raises(ValueError, match="on_error must be one of raise, fallback"):
        build_drafter("ngram", target, tokenizer, 100, on_error="ignore")
    with pytest.raises(Exception):  # strict: the loader's own error, no fallback
        build_drafter(str(folders / "corrupt"), target, tokenizer, 100)
    loaded = build_drafter(f"ngram+{folders / 'corrupt'}", target, tokenizer, 100, on_error="fallback")
    assert loaded.name == "ngram" and "loading failed" in loaded.warning and "target alone" not in loaded.warning
    alone = build_drafter(str(folders / "corrupt"), target, tokenizer, 100, on_error="fallback")
    assert alone.drafter is None and alone.name == "none" and alone.warning.endswith("running the target alone")
    tight = build_drafter(str(folders / "draft"), target, tokenizer, 100, on_error="fallback", free_bytes=10_000)
    assert tight.drafter is None and "not enough memory" in tight.warning


def test_the_head_slack_holds_the_deepest_widest_tree(target, folders):
    """K = MAX_DRAFT_TOKENS - 1 with a tree budget above it: every depth below the deepest expands TREE_BEAM nodes,
    the most a round writes past the committed sequence, on a sequence as long as the head lets draft that deep."""
    from verispec.drafters.head import load_head

    assert head_module.TREE_SLACK == (MAX_DRAFT_TOKENS - 1) * TREE_BEAM
    config, weights = load_head(folders / "head")
    k, length = MAX_DRAFT_TOKENS - 1, 80
    head = HeadDrafter(config, weights, target, length)
    tokens = torch.randint(0, VOCAB, (length - k,), generator=torch.Generator().manual_seed(0))  # room for k exactly
    head.begin(0, tokens)
    head.observe_features(0, torch.randn(tokens.numel() - 1, config.hidden_size))
    batch = draft_batch([tokens], [k])
    batch.rows[0].tree_nodes = MAX_DRAFT_TOKENS
    proposal = head.propose(batch)[0]
    assert proposal.parents is not None and proposal.token_ids.numel() == MAX_DRAFT_TOKENS
    assert head.cache.lengths[0] == tokens.numel() - 1  # draft entries are stale: the slot keeps the real pairs only
