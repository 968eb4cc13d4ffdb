"""`--draft-model` parsed once (drafters/spec.py): each form of the value, and a ValueError naming the fix for each
malformed one. No model is loaded: parsing looks at names and at folders on disk only."""

from __future__ import annotations

import re

import pytest

from verispec.drafters.spec import (DEFAULT_HEAD, DEFAULT_HEAD_DIR, DraftStage, DrafterSpec, parse_drafter_spec)

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


def kinds(value) -> list[tuple[str, str]]:
    return [(stage.kind, stage.name) for stage in parse_drafter_spec(value).stages]


def test_each_form_of_the_value(tmp_path):
    assert parse_drafter_spec(None) == parse_drafter_spec("none") == DrafterSpec("none")
    assert kinds("ngram") == [("named", "ngram")] and kinds("random") == [("named", "random")]
    assert kinds("auto") == [("auto", "auto")]
    assert kinds("some/draft") == [("model", "some/draft")] and parse_drafter_spec("some/draft").model == "some/draft"
    cascade = parse_drafter_spec("ngram + some/draft")
    assert kinds(cascade) == [("named", "ngram"), ("model", "some/draft")] and cascade.model == "some/draft"
    assert parse_drafter_spec("ngram").model is None and parse_drafter_spec(cascade) is cascade
    head = tmp_path / "my+head"  # an existing path is never split at '+'
    head.mkdir()
    (head / "head_config.json").write_text("{}")
    assert parse_drafter_spec(str(head)).stages == (DraftStage("head", str(head), head),)
    plain = tmp_path / "head"
    plain.mkdir()
    (plain / "head_config.json").write_text("{}")
    assert parse_drafter_spec(f"ngram+head:{plain}").stages[1] == DraftStage("head", f"head:{plain}", plain)
    assert parse_drafter_spec(DEFAULT_HEAD).stages[0].head_dir == DEFAULT_HEAD_DIR
    assert kinds("self:int8") == [("twin", "self:int8")] and parse_drafter_spec("self:int4").model is None
    assert kinds("ngram+self:int4+some/draft") == [("named", "ngram"), ("twin", "self:int4"), ("model", "some/draft")]


@pytest.mark.parametrize("value, message", [
    ("ngram+none", "'none' cannot be part of a '+' list"),
    ("a/draft+b/draft", "at most one draft model, got a/draft, b/draft"),
    ("ngram+", "empty drafter in a '+' list"),
    ("", "--draft-model is empty"),
    ("head:/no/such/head", "holds no draft head"),
    ("self:int3", "unknown twin format 'int3'; choose from self:int8, self:int4, self:q4_0, self:q4_1, self:q8_0"),
])
def test_malformed_values_name_the_fix(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_drafter_spec(value)


def test_stages_are_validated():
    with pytest.raises(ValueError, match="drafter kind must be one of"):
        DraftStage("lookup", "x")
    with pytest.raises(ValueError, match="head_dir"):
        DraftStage("head", "head:x")
