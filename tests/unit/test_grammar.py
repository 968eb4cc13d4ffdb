"""Structured output's building block, `Grammar` (llguidance): masks per draft position with rollback, the cut of
forbidden drafts, forced tokens, and the logits processing that applies the masks to p and q alike."""

from __future__ import annotations

import pytest
import torch

from conftest import EOS_ID, JSON_CHARS, make_tokenizer

from verispec.config import SamplingParams, StructuredOutput
from verispec.sampling import Grammar, RowSamplingState, SamplingBatch, process_logits


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(JSON_CHARS)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def allowed(tok, mask_row: torch.Tensor) -> set[str]:
    return {tok.decode([t]) if t != EOS_ID else "<eos>" for t in mask_row.nonzero().flatten().tolist()}


def grammar(tok, kind="regex", spec="", choices=()) -> Grammar:
    return Grammar(StructuredOutput(kind, spec, choices), tok, len(tok), [EOS_ID])


def test_masks_follow_the_draft_and_roll_back(tok):
    g = grammar(tok, spec="(ab|ba)c")
    masks = g.masks(ids(tok, "ba"), [0, 1, 2])
    assert [allowed(tok, m) for m in masks] == [{"a", "b"}, {"a"}, {"c"}]
    # Nothing was consumed: the committed state is where it was, and a different draft gets its own masks.
    assert [allowed(tok, m) for m in g.masks(ids(tok, "ab"), [0, 1, 2])] == [{"a", "b"}, {"b"}, {"c"}]
    g.commit(ids(tok, "abc"))
    assert allowed(tok, g.masks([], [0])[0]) == {"<eos>"}


def test_a_forbidden_draft_token_is_cut_and_later_positions_allow_anything(tok):
    g = grammar(tok, spec="(ab|ba)c")
    draft = ids(tok, "axc")
    assert g.valid_prefix(draft) == 1
    masks = g.masks(draft, [0, 1, 2, 3])
    assert allowed(tok, masks[1]) == {"b"} and masks[2].all() and masks[3].all()


def test_forced_tokens_and_choices(tok):
    g = grammar(tok, "json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')
    assert tok.decode(g.forced_tokens()) == '{"a":'
    c = grammar(tok, "choice", choices=("yes", "no"))
    assert allowed(tok, c.masks([], [0])[0]) == {"y", "n"} and c.forced_tokens() == []
    c.commit(ids(tok, "y"))
    assert tok.decode(c.forced_tokens()) == "es"


def test_a_grammar_this_vocabulary_cannot_spell_ends_the_output(tok):
    g = grammar(tok, spec="é+")  # no token of this vocabulary starts with é
    assert allowed(tok, g.masks([], [0])[0]) == {"<eos>"}


def test_bad_constraints_raise_value_errors_naming_them(tok):
    with pytest.raises(ValueError, match="regex constraint cannot be compiled"):
        grammar(tok, spec="(unclosed")
    with pytest.raises(ValueError, match="JSON schema is not valid JSON"):
        grammar(tok, "json_schema", "{not json")
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        Grammar(StructuredOutput("json_object"), None, len(tok), [EOS_ID])
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        SamplingParams(ignore_eos=True, structured=StructuredOutput("json_object"))
    with pytest.raises(ValueError, match="logit_bias values must be in"):
        SamplingParams(logit_bias={3: 500})


def test_process_logits_masks_each_position_after_its_draft_prefix(tok):
    """Rows without a grammar are untouched; a grammar row's position i sees pending[:start + i]."""
    vocab = len(tok)
    params = SamplingParams(structured=StructuredOutput("regex", "(ab|ba)c"), logit_bias={ids(tok, "c")[0]: 2.5})
    rows = [RowSamplingState(params, [EOS_ID], [1], vocab, "cpu", grammar(tok, spec="(ab|ba)c")),
            RowSamplingState(SamplingParams(), [EOS_ID], [1], vocab, "cpu")]
    batch = SamplingBatch.stack(rows, vocab, "cpu")
    logits = torch.zeros(2, 3, vocab)
    pending = torch.tensor([ids(tok, "ba"), ids(tok, "zz")])
    out = process_logits(logits, batch, pending)
    finite = [[allowed(tok, torch.isfinite(out[b, i])) for i in range(3)] for b in range(2)]
    assert finite[0] == [{"a", "b"}, {"a"}, {"c"}]
    assert all(len(s) == vocab for s in finite[1])
    assert out[0, 2, ids(tok, "c")[0]].item() == 2.5 and out[1].abs().sum() == 0
    # The drafter's call shape: one position after two drafted tokens (start=2).
    one = process_logits(logits[:, :1], batch, pending, start=2)
    assert allowed(tok, torch.isfinite(one[0, 0])) == {"c"}
