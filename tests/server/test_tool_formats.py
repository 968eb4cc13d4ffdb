"""Tool calling's pure parts (server/tools/): the checks of a request's tools, each format's grammar per tool_choice
(what it allows and refuses, through llguidance on a character tokenizer), reading calls back from text whole and
streamed in any pieces, the generic format's prompt, history calls whose arguments are no JSON object, arguments
closed to undeclared keys, and which format a chat template gets."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer

from conftest import JSON_CHARS, make_tokenizer
from verispec.server.errors import APIError
from verispec.server.tools import (ToolStream, detect_format, history_arguments, normalise, read, schema_errors,
                                   tool_request)
from verispec.server.tools.generic import GenericFormat
from verispec.server.tools.hermes import HermesFormat
from verispec.server.tools.llama3 import Llama3Format
from verispec.server.tools.spec import closed
from verispec.server.tools.syntax import json_end

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time"}}]
NAMED = {"type": "function", "function": {"name": "time"}}

# Hand-written templates in the style of Qwen2.5 (Hermes) and Llama 3.1, enough to render tools and a history.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nFunctions:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\nCall one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nAnswer with a JSON call {\"name\": function name, "
    "\"parameters\": its arguments}.\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"parameters\": "
    "{{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

GENERIC_CALLS = '{"tool_calls":[{"name":"weather","arguments":{"city":"Paris","days":2}},{"name":"time","arguments":{}}]}'
HERMES_CALLS = ('<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
                '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')
LLAMA3_CALL = '{"name": "weather", "parameters": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer(JSON_CHARS + list("<>/|"))


@pytest.fixture(scope="module")
def ll(tokenizer):
    return from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])


def accepts(ll, tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar allows exactly `text` as a whole answer."""
    matcher = LLMatcher(ll, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if matcher.validate_tokens(ids) != len(ids):
        return False
    for token in ids:
        matcher.consume_token(token)
    return matcher.is_accepting()


# -- the request's tools ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tools, choice, parallel, param", [
    ([{"type": "custom", "custom": {"name": "f"}}], None, None, "tools.0.type"),
    ([{"type": "function"}], None, None, "tools.0.function"),
    ([{"type": "function", "function": {"name": "has space"}}], None, None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f" * 65}}], None, None, "tools.0.function.name"),
    ([TOOLS[0], {"type": "function", "function": {"name": "weather"}}], None, None, "tools.1.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, None,
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, None, "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None, None, "tools.0.function.description"),
    (TOOLS, "sometimes", None, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
    (TOOLS, {"type": "allowed_tools", "allowed_tools": {}}, None, "tool_choice"),
    (None, "required", None, "tool_choice"),
    (TOOLS, None, "yes", "parallel_tool_calls"),
])
def test_bad_tools_are_400s_naming_the_field(tools, choice, parallel, param):
    with pytest.raises(APIError) as error:
        tool_request(tools, choice, parallel)
    assert error.value.status == 400 and error.value.param == param and error.value.message


def test_the_request_as_parsed():
    assert tool_request(None, None, None) is None and tool_request([], "none", None) is None
    assert tool_request(None, "auto", True) is None
    request = tool_request(TOOLS, None, None)
    assert request.mode == "auto" and request.parallel and [t.name for t in request.callable] == ["weather", "time"]
    assert request.tools[1].parameters == {"type": "object", "properties": {}}  # no parameters: no arguments
    named = tool_request(TOOLS, NAMED, False)
    assert named.mode == "named" and [t.name for t in named.callable] == ["time"] and not named.parallel
    assert not tool_request(TOOLS, "none", None).calls


def test_schema_errors_name_the_tool():
    assert schema_errors(tool_request(TOOLS, None, None)) is None
    bad = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strng"}}}}}]
    index, why = schema_errors(tool_request(bad, None, None))
    assert index == 1 and "strng" in why


# -- grammars --------------------------------------------------------------------------------------------------------

FORMATS = {"generic": (GenericFormat(), GENERIC_CALLS), "hermes": (HermesFormat(), HERMES_CALLS),
           "llama3": (Llama3Format(), LLAMA3_CALL)}


@pytest.mark.parametrize("name", FORMATS)
def test_each_grammar_allows_what_tool_choice_says(ll, tokenizer, name):
    fmt, calls = FORMATS[name]
    one_time = read(calls, fmt.syntax, final=True)
    auto, required = (fmt.grammar(tool_request(TOOLS, choice, None)) for choice in ("auto", "required"))
    named = fmt.grammar(tool_request(TOOLS, NAMED, None))
    assert accepts(ll, tokenizer, auto, "It is sunny.") and accepts(ll, tokenizer, auto, calls)
    assert accepts(ll, tokenizer, required, calls) and not accepts(ll, tokenizer, required, "It is sunny.")
    assert not accepts(ll, tokenizer, named, calls)  # calls weather
    assert len(one_time.calls) == (1 if fmt.single_call else 2)
    bad_args = calls.replace("Paris", "Paris\",\"extra\":\"x")  # weather allows no other property
    bad_name = calls.replace("weather", "wether")
    for grammar in (auto, required):
        assert not accepts(ll, tokenizer, grammar, bad_args) and not accepts(ll, tokenizer, grammar, bad_name)


def test_one_call_when_parallel_calls_are_off(ll, tokenizer):
    for fmt, calls in (FORMATS["generic"], FORMATS["hermes"]):
        grammar = fmt.grammar(tool_request(TOOLS, "required", False))
        first = calls[: calls.index("time") - len(fmt.syntax.separator) - len(fmt.syntax.call_open)] + fmt.syntax.close
        assert accepts(ll, tokenizer, grammar, first) and not accepts(ll, tokenizer, grammar, calls)


def test_a_trigger_in_text_starts_a_constrained_call(ll, tokenizer):
    hermes = HermesFormat().grammar(tool_request(TOOLS, "auto", None))
    assert accepts(ll, tokenizer, hermes, "Let me look. " + HERMES_CALLS)
    assert not accepts(ll, tokenizer, hermes, "Let me look. <tool_call>\nanything")
    generic = GenericFormat().grammar(tool_request(TOOLS, "auto", None))
    assert accepts(ll, tokenizer, generic, "") and not accepts(ll, tokenizer, generic, '{"city": "Paris"}')


def test_named_choice_calls_only_that_function(ll, tokenizer):
    grammar = GenericFormat().grammar(tool_request(TOOLS, NAMED, None))
    assert accepts(ll, tokenizer, grammar, '{"tool_calls":[{"name":"time","arguments":{}}]}')
    assert not accepts(ll, tokenizer, grammar, '{"tool_calls":[{"name":"weather","arguments":{"city":"x"}}]}')


# -- reading calls ---------------------------------------------------------------------------------------------------


def test_json_end():
    assert json_end('{"a":"}","b":[1,{"c":2}]}x', 0) == 25
    assert json_end('{"a":"\\"}"}', 0) == 11
    assert json_end('{"a":1', 0) is None and json_end('"ab', 0) is None and json_end("12", 0) is None
    assert json_end("12}", 0) == 2 and json_end("[]", 0) == 2


@pytest.mark.parametrize("name, text, content, calls", [
    ("generic", GENERIC_CALLS, "", [("weather", '{"city":"Paris","days":2}'), ("time", "{}")]),
    ("generic", "Plain {text}", "Plain {text}", []),
    ("generic", '{"tool_calls":[{"name":"wea', '{"tool_calls":[{"name":"wea', []),  # cut by max_tokens
    ("hermes", "Checking. " + HERMES_CALLS, "Checking. ", [("weather", '{"city": "Paris", "days": 2}'),
                                                          ("time", "{}")]),
    ("hermes", "a <tool", "a <tool", []),
    ("llama3", LLAMA3_CALL, "", [("weather", '{"city": "Paris"}')]),
    ("llama3", '{"name": "weather", "parameters": {"city": "Par', "", [("weather", '{"city": "Par')]),
])
def test_read_whole(name, text, content, calls):
    out = read(text, FORMATS[name][0].syntax, final=True)
    assert out.content == content and [(c.name, c.arguments) for c in out.calls] == calls


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_pieces_add_up_to_the_whole(name, size):
    fmt, calls = FORMATS[name]
    for text in (calls, "Just text <tool_ or {so}", "Before. " + calls, calls[: len(calls) // 2]):
        whole = read(text, fmt.syntax, final=True)
        stream = ToolStream(fmt.syntax)
        content, names, arguments = "", {}, {}
        pieces = [stream.feed(text[i: i + size]) for i in range(0, len(text), size)] + [stream.finish()]
        for piece, deltas in pieces:
            content += piece
            for d in deltas:
                if d.id is not None:
                    assert d.index == len(names) and d.name and d.id.startswith("call_")
                    names[d.index] = d.name
                arguments[d.index] = arguments.get(d.index, "") + d.arguments
        assert content == whole.content
        assert [(names[i], arguments[i]) for i in sorted(names)] == [(c.name, c.arguments) for c in whole.calls]
        assert len(stream.ids) == len(whole.calls)


def test_content_before_a_trigger_is_held_back_until_decided():
    stream = ToolStream(HermesFormat.syntax)
    assert stream.feed("Sure <tool") == ("Sure ", [])
    assert stream.feed("s> are") == ("<tools> are", [])


# -- prompts ---------------------------------------------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "weather",
                                                         "arguments": {"city": "Paris"}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": None},
    {"role": "tool", "content": "22C", "tool_call_id": "call_1", "name": None},
]


def test_generic_prompt_writes_tools_and_history():
    messages, template_tools = GenericFormat().prompt(normalise(HISTORY), tool_request(TOOLS, None, None))
    assert template_tools is None
    system = messages[0]["content"]
    assert messages[0]["role"] == "system" and '"name":"weather"' in system and '"tool_calls"' in system
    assert messages[2] == {"role": "assistant",
                           "content": '{"tool_calls":[{"name":"weather","arguments":{"city":"Paris"}}]}'}
    assert messages[3] == {"role": "user", "content": 'Tool results:\n{"name":"weather","content":"sunny"}\n'
                                                      '{"name":"weather","content":"22C"}'}
    plain, _ = GenericFormat().prompt(normalise(HISTORY), tool_request(TOOLS, "none", None))
    assert plain[0]["role"] == "user"  # tool_choice none: no tools shown


@pytest.mark.parametrize("template, name", [(None, "generic"), (HERMES_TEMPLATE, "hermes"),
                                            (LLAMA3_TEMPLATE, "llama3_json")])
def test_format_follows_the_chat_template(template, name):
    tokenizer = make_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    assert detect_format(tokenizer).name == name  # the test tokenizer's own template renders no tools: generic


def test_the_embedded_smollm2_template_gets_the_generic_format():
    from importlib import resources

    tokenizer = make_tokenizer()
    tokenizer.chat_template = resources.files("verispec").joinpath(
        "assets/default_draft/chat_template.jinja").read_text()
    assert detect_format(tokenizer).name == "generic"


def test_template_formats_render_the_history_through_the_template():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    messages, tools = HermesFormat().prompt(normalise(HISTORY), tool_request(TOOLS, None, None))
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "weather"' in text and '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny" in text and json.dumps(tools[0]) in text


def test_history_call_with_arguments_that_are_no_object_is_written_as_sent():
    """OpenAI accepts any string as a history call's arguments (an agent loop sends back a call cut by max_tokens):
    the message is written as the model would have written it, the string in place of the arguments."""
    cut = [{"role": "user", "content": "weather?"},
           {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "name": "weather",
                                                                "arguments": history_arguments('{"city": "Pa')}]}]
    assert history_arguments('{"city": "Paris"}') == {"city": "Paris"} and history_arguments("[1]") == "[1]"
    generic, _ = GenericFormat().prompt(normalise(cut), tool_request(TOOLS, None, None))
    assert generic[-1] == {"role": "assistant",
                           "content": '{"tool_calls":[{"name":"weather","arguments":{"city": "Pa}]}'}
    tokenizer = make_tokenizer()
    tokenizer.chat_template = HERMES_TEMPLATE
    messages, tools = HermesFormat().prompt(normalise([*cut[:1], {**cut[1], "content": "Let me see."}]), None)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert '<|im_start|>assistant\nLet me see.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Pa}\n' \
           '</tool_call><|im_end|>' in text
    # A whole call goes through the template as before, written the same way.
    whole = [{**cut[1], "tool_calls": [{"id": "call_1", "name": "weather", "arguments": {"city": "Paris"}}]}]
    via_template = tokenizer.apply_chat_template(HermesFormat().prompt(whole, None)[0], tokenize=False)
    assert HermesFormat().calls_text(whole[0]["tool_calls"]) in via_template


# -- arguments hold only declared keys -------------------------------------------------------------------------------

OPEN_CITY = {"type": "object", "properties": {"city": {"type": "string"}, "where": {
    "type": "object", "properties": {"lat": {"type": "number"}}}}, "required": ["city"]}


def test_closed_adds_additional_properties_false_where_the_schema_says_nothing():
    out = closed(OPEN_CITY)
    assert out["additionalProperties"] is False and out["properties"]["where"]["additionalProperties"] is False
    assert OPEN_CITY.get("additionalProperties") is None  # the given schema is not changed
    assert closed({**OPEN_CITY, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in closed({"type": "object", "patternProperties": {"^x": {}},
                                                 "properties": {}})
    assert "additionalProperties" not in closed({"type": "object"})  # a free-form object stays free-form
    branches = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed(branches) == branches  # allOf's branches combine: none is closed
    assert closed({"$defs": {"p": {"properties": {}}}, "anyOf": [{"properties": {}}], "items": {"properties": {}}}) == {
        "$defs": {"p": {"properties": {}, "additionalProperties": False}},
        "anyOf": [{"properties": {}, "additionalProperties": False}],
        "items": {"properties": {}, "additionalProperties": False}}


@pytest.mark.parametrize("name", FORMATS)
def test_a_call_cannot_invent_a_key(ll, tokenizer, name):
    """A schema that does not say additionalProperties holds a call to its keys (nested objects too); one that allows
    them still does (the negative control). The model is shown the schema as given."""
    fmt, _ = FORMATS[name]

    def grammar(schema):
        return fmt.grammar(tool_request([{"type": "function", "function": {"name": "weather", "parameters": schema}}],
                                        "required", None))

    def call(arguments: str) -> str:
        s = fmt.syntax
        return s.open + s.call_open + "weather" + s.args_open + arguments + s.call_close + s.close

    sep = ", " if name != "generic" else ","
    given, extra = call('{"city": "Paris"}'.replace(", ", sep)), call(f'{{"city": "Paris"{sep}"zzz": 1}}')
    nested = call(f'{{"city": "Paris"{sep}"where": {{"lat": 1{sep}"zzz": 2}}}}')
    if name == "generic":
        given, extra, nested = (t.replace('": ', '":') for t in (given, extra, nested))
    assert accepts(ll, tokenizer, grammar(OPEN_CITY), given)
    assert not accepts(ll, tokenizer, grammar(OPEN_CITY), extra)
    assert not accepts(ll, tokenizer, grammar(OPEN_CITY), nested)
    allowing = {**OPEN_CITY, "additionalProperties": True,
                "properties": {**OPEN_CITY["properties"], "where": {**OPEN_CITY["properties"]["where"],
                                                                    "additionalProperties": True}}}
    assert accepts(ll, tokenizer, grammar(allowing), extra) and accepts(ll, tokenizer, grammar(allowing), nested)
    request = tool_request([{"type": "function", "function": {"name": "weather", "parameters": OPEN_CITY}}], None, None)
    assert request.tools[0].as_openai()["function"]["parameters"] == OPEN_CITY
