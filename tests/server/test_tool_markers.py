"""Hermes calls whose `<tool_call>` / `</tool_call>` are special tokens (Qwen2.5-Coder's tokenizer): the format
learns them from the tokenizer, its grammar writes them by token id (only the token opens a call, spelling it out
is text and a plain answer may not), and `MarkedText` puts them back into the engine's text, round by round,
behind held-back text and never past a stop string's cut, so `read` finds the calls."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer

from conftest import JSON_CHARS, make_tokenizer
from test_tool_formats import HERMES_CALLS, HERMES_TEMPLATE, NAMED, TOOLS, accepts

from verispec.config import SamplingParams
from verispec.engine.detokenize import StopChecker
from verispec.server.tools import ToolStream, detect_format, read, tool_request
from verispec.server.tools.hermes import HermesFormat
from verispec.server.tools.markers import MarkedText, special_markers

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit

MARKERS = ["<tool_call>", "</tool_call>"]


def special_tokenizer(special: bool = True):
    """The character tokenizer with the markers added as tokens (special, or ordinary added tokens as in Qwen2.5)."""
    tokenizer = make_tokenizer(JSON_CHARS + list("<>/|"))
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *MARKERS]})
    else:
        tokenizer.add_tokens(MARKERS)
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return special_tokenizer()


@pytest.fixture(scope="module")
def ll(tokenizer):
    return from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])


def test_the_format_learns_which_markers_are_special(tokenizer):
    ids = {m: tokenizer.convert_tokens_to_ids(m) for m in MARKERS}
    assert detect_format(tokenizer).special_tokens == ids
    assert tokenizer.decode(tokenizer(HERMES_CALLS)["input_ids"], skip_special_tokens=True).count("tool_call") == 0
    assert special_markers(special_tokenizer(special=False), MARKERS) == {}  # kept in the text: nothing to do
    assert special_markers(make_tokenizer(JSON_CHARS + list("<>/|")), MARKERS) == {}  # spelled by characters
    assert detect_format(special_tokenizer(special=False)).grammar(tool_request(TOOLS, "required", None)).startswith(
        'start: "<tool_call>\\n"')


def test_the_grammar_opens_calls_with_the_token_only(ll, tokenizer):
    fmt = detect_format(tokenizer)
    auto, required = (fmt.grammar(tool_request(TOOLS, choice, None)) for choice in ("auto", "required"))
    named = fmt.grammar(tool_request(TOOLS, NAMED, None))
    ids = fmt.special_tokens
    assert f"<[{ids['<tool_call>']}]>" in required and f"<[{ids['</tool_call>']}]>" in required
    for grammar in (auto, required):
        assert accepts(ll, tokenizer, grammar, HERMES_CALLS)  # the markers tokenize as the special tokens
        assert not accepts(ll, tokenizer, grammar, HERMES_CALLS.replace("Paris", 'Paris", "extra": "x'))
    assert accepts(ll, tokenizer, auto, "Let me look. " + HERMES_CALLS) and accepts(ll, tokenizer, auto, "Sunny.")
    assert not accepts(ll, tokenizer, required, "Sunny.") and not accepts(ll, tokenizer, named, HERMES_CALLS)
    # Spelled out character by character, a marker is text: it cannot open a call, nor be said in a plain answer.
    spelled = [t for c in "<tool_call>" for t in tokenizer(c, add_special_tokens=False)["input_ids"]]
    assert len(spelled) == len("<tool_call>")
    text = tokenizer("Look: ", add_special_tokens=False)["input_ids"] + spelled
    assert LLMatcher(ll, LLMatcher.grammar_from_lark(auto), log_level=0).validate_tokens(text) == len(text) - 1
    assert LLMatcher(ll, LLMatcher.grammar_from_lark(required), log_level=0).validate_tokens(spelled) == 0


def rounds(tokenizer, text: str, sizes: int, stop: tuple[str, ...] = ()) -> tuple[str, str]:
    """Commit `text`'s tokens `sizes` at a time through the engine's stop checker, as the worker takes them
    (token ids and the text let out per round), through MarkedText. -> (marked text, the engine's own text)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stopper = StopChecker(SamplingParams(stop=stop, max_new_tokens=1000), [tokenizer.eos_token_id], tokenizer, 1000)
    marks = MarkedText(tokenizer, special_markers(tokenizer, MARKERS))
    marked, plain = "", ""
    for start in range(0, len(ids), sizes):
        piece = ids[start: start + sizes]
        for token in piece:
            if stopper.push(token):
                break
        delta = stopper.take_text()
        plain += delta
        marked += marks.feed(piece, delta)
        if stopper.finish_reason:
            break
    return marked, plain


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_marked_text_is_the_text_with_its_markers(tokenizer, size):
    text = "Let me look. " + HERMES_CALLS
    marked, plain = rounds(tokenizer, text, size)
    assert marked == text and "tool_call" not in plain
    assert [(c.name, c.arguments) for c in read(marked, HermesFormat.syntax, final=True).calls] == [
        ("weather", '{"city": "Paris", "days": 2}'), ("time", "{}")]
    # Round by round through ToolStream, the calls add up to the same.
    stream = ToolStream(HermesFormat.syntax)
    stream.feed(marked)
    assert len(stream.ids) == 2


def test_markers_wait_behind_held_text_and_stop_at_a_stop_string(tokenizer):
    # "lo" might begin the stop string "look!": held back, and the marker after it waits for it.
    marked, _ = rounds(tokenizer, "lo" + HERMES_CALLS, 1, stop=("look!",))
    assert marked == "lo" + HERMES_CALLS
    # The stop string cuts the text before the calls: no marker after the cut comes out.
    marked, plain = rounds(tokenizer, "ok STOP" + HERMES_CALLS, 3, stop=("STOP",))
    assert marked == plain == "ok "
