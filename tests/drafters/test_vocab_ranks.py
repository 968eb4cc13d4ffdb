"""A draft model's reduced head, chosen before anything loads: which ids it keeps (drafters/vocab_ranks.py: the
ranked table's first N, the special tokens always, a short table continued in id order, the first ids where no
table knows the tokenizer) and how the drafter value asks for it (':vN', ':vfull'; drafters/spec.py)."""

from __future__ import annotations

import numpy as np
import pytest

from verispec.drafters import vocab_ranks
from verispec.drafters.spec import DraftStage, parse_drafter_spec
from verispec.drafters.vocab_ranks import DEFAULT_DRAFT_VOCAB, MIN_DRAFT_VOCAB, head_ids

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


def test_head_ids_by_hand():
    ranked = np.array([7, 3, 9, 0, 5])
    assert head_ids(ranked, 3, 12, always=[11]).tolist() == [3, 7, 9, 11]  # ascending, the end token kept
    assert head_ids(ranked, 7, 12, always=[]).tolist() == [0, 1, 2, 3, 5, 7, 9]  # continued by id: 1, 2
    assert head_ids(None, 4, 12, always=[10, 2, 40]).tolist() == [0, 1, 2, 3, 10]  # no table: the first ids
    assert head_ids(np.array([20, 4]), 2, 12, always=[]).tolist() == [0, 4]  # ids past the vocabulary dropped


def test_draft_head_ids_default_and_full(monkeypatch):
    class Tokenizer:
        all_special_ids = [10]
        added_tokens_decoder = {11: None}

    monkeypatch.setattr(vocab_ranks, "ranked_ids", lambda tokenizer: np.arange(4095, -1, -1))
    monkeypatch.setattr(vocab_ranks, "DEFAULT_DRAFT_VOCAB", 2048)
    ids = vocab_ranks.draft_head_ids(None, Tokenizer(), None, 5000)
    assert ids.tolist() == [10, 11] + list(range(2048, 4096))
    assert vocab_ranks.draft_head_ids(0, Tokenizer(), None, 5000) is None  # ':vfull'
    assert vocab_ranks.draft_head_ids(8000, Tokenizer(), None, 5000) is None  # no fewer rows than the head has
    monkeypatch.setattr(vocab_ranks, "ranked_ids", lambda tokenizer: None)
    assert vocab_ranks.draft_head_ids(None, Tokenizer(), None, 5000) is None  # no table: the whole head
    assert vocab_ranks.draft_head_ids(1024, Tokenizer(), None, 5000).tolist() == list(range(1024))


def test_the_drafter_value_asks_for_a_head_size(tmp_path):
    stage = parse_drafter_spec("qwen2.5-coder-0.5b-instruct:v16384").stages[0]
    assert (stage.kind, stage.name, stage.draft_vocab) == ("model", "qwen2.5-coder-0.5b-instruct", 16384)
    assert stage.label == "qwen2.5-coder-0.5b-instruct:v16384"
    spec = parse_drafter_spec("suffix+some/draft:vfull")
    assert spec.model == "some/draft" and spec.model_stage.draft_vocab == 0 and spec.model_stage.label.endswith(":vfull")
    assert parse_drafter_spec("some/draft").model_stage.draft_vocab is None
    odd = tmp_path / "odd:v8"  # an existing path keeps its name whole
    odd.write_text("")
    assert parse_drafter_spec(str(odd)).stages[0] == DraftStage("model", str(odd))
    with pytest.raises(ValueError, match=f":v{DEFAULT_DRAFT_VOCAB}"):
        parse_drafter_spec("some/draft:vmany")
    with pytest.raises(ValueError, match=f"at least {MIN_DRAFT_VOCAB}"):
        parse_drafter_spec("some/draft:v100")
    with pytest.raises(ValueError, match="only a draft model"):
        DraftStage("named", "ngram", draft_vocab=4096)
