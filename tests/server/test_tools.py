"""Tool calling end to end: a real server on loopback, the official `openai` client, tiny fp32 models.

An agent loop (call -> tool result -> answer), streamed (through the client's own stream state and `.stream()`
helper) and not; every tool_choice honoured, every call valid against its function's schema; outputs identical with
speculation on and off (greedy with each drafter and K, and coupled seeded sampling); the stream's chunks as OpenAI
sends them; bad definitions as 400s naming the field. The default server's models have a character vocabulary that
spells JSON and a chat template without tools (the generic format); a second server's template renders tools in
the Hermes style (Qwen2.5's). The real SmolLM2 is the slow test at the end.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import JSON_CHARS, _common, make_tokenizer, train_on_corpus
from test_server import ServerThread
from test_tool_formats import HERMES_TEMPLATE
from test_tool_markers import special_tokenizer

from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app
from verispec.server.resume import PROGRESS_HEADER, RESUME_HEADER

MODEL = "target"
MAX_LEN = 2048  # the generic format's system prompt is ~900 characters: tokens, with this vocabulary
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": ZONE}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE}
NAMED = {"type": "function", "function": {"name": "get_time"}}
QUESTION = [{"role": "user", "content": "the weather in Paris"}]
SPEC_OFF = {"enabled": False}


def tiny_llama(seed: int, hidden: int, layers: int, vocab: int) -> LlamaForCausalLM:
    """conftest's tiny Llama, with room for the tools' system prompt."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LEN,
                         **_common(vocab))
    return LlamaForCausalLM(config).eval()


def save_pair(root, tokenizer, steps: tuple[int, int]) -> dict:
    vocab = len(tokenizer)
    models = {"target": train_on_corpus(tiny_llama(30, 64, 2, vocab), tokenizer, steps=steps[0]),
              "draft": train_on_corpus(tiny_llama(31, 32, 1, vocab), tokenizer, steps=steps[1])}
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {name: root / name for name in models}


def serve(dirs, **extra) -> ServerThread:
    draft = str(dirs["draft"])
    config = ServerConfig(model=str(dirs["target"]), draft_model=draft, enable_speculative=True,
                          spec=SpeculativeConfig(num_draft_tokens=4), max_len=MAX_LEN, dtype="float32",
                          allowed_draft_models=("ngram", f"cascade=ngram+{draft}"), **extra)
    return ServerThread(create_app(config))


@pytest.fixture(scope="module")
def base_url(tmp_path_factory, one_thread):
    dirs = save_pair(tmp_path_factory.mktemp("tool_models"), make_tokenizer(JSON_CHARS), (150, 60))
    with serve(dirs) as running:
        yield running.url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, choice="required", messages=QUESTION, speculative=None, max_tokens=120, **extra):
    """One greedy chat request with TOOLS; extra: the client's own arguments (seed, temperature, n, ...)."""
    extra.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice,
                                          max_tokens=max_tokens, extra_body={"speculative": speculative or {}},
                                          **extra)


def streamed(client, choice="required", messages=QUESTION, speculative=None, max_tokens=120, **extra):
    """The same request streamed, its chunks added up by the official client's ChatCompletionStreamState."""
    extra.setdefault("temperature", 0)
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice,
                                                max_tokens=max_tokens, stream=True,
                                                extra_body={"speculative": speculative or {}}, **extra):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


def answer(response) -> list[tuple]:
    """Per choice: (finish reason, content, [(name, arguments)]): what must not depend on speculation."""
    return [(c.finish_reason, c.message.content, [(t.function.name, t.function.arguments)
                                                  for t in c.message.tool_calls or []]) for c in response.choices]


def check_calls(message, names=SCHEMAS, cut: bool = False) -> list[dict]:
    """Each call names a declared function and its arguments validate against that function's schema (`cut`: the
    answer ended at max_tokens, so its last call's arguments may be incomplete)."""
    out = []
    for call in message.tool_calls[: -1 if cut else None]:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append(arguments)
    return out


def run_tool(call) -> str:
    arguments = json.loads(call.function.arguments)
    return f"sunny in {arguments['city']}" if call.function.name == "get_weather" else f"noon {arguments['zone']}"


# -- the agent loop --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_agent_loop_call_result_answer(client, stream):
    """Call (required) -> the tool's result -> the answer (auto), as an agent framework runs it."""
    messages = [{"role": "system", "content": "be brief"}, *QUESTION]
    if stream:
        with client.chat.completions.stream(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=120) as events:
            kinds = {event.type for event in events}
            first = events.get_final_completion()
        assert {"tool_calls.function.arguments.delta", "tool_calls.function.arguments.done"} <= kinds
    else:
        first = ask(client, messages=messages, parallel_tool_calls=False)
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [arguments] = check_calls(choice.message)
    [call] = choice.message.tool_calls
    messages += [choice.message,  # the message object itself, as OpenAI's examples append it
                 {"role": "tool", "tool_call_id": call.id, "content": run_tool(call)}]
    final = (streamed if stream else ask)(client, "auto", messages, max_tokens=24)
    [done] = final.choices
    assert done.finish_reason in ("stop", "length", "tool_calls")
    if done.message.tool_calls:
        check_calls(done.message)
    else:
        assert done.message.content
    # The same loop the other way (streamed / not) gives the same call and the same answer.
    other = (ask if stream else streamed)(client, "required", messages[:2], parallel_tool_calls=False)
    assert answer(other) == answer(first)
    assert answer((ask if stream else streamed)(client, "auto", messages, max_tokens=24)) == answer(final)
    assert arguments == json.loads(call.function.arguments)


def test_every_tool_choice_is_honoured(client):
    auto, none = ask(client, "auto"), ask(client, "none", max_tokens=24)
    required, named = ask(client, "required"), ask(client, NAMED)
    for response in (required, named):
        assert response.choices[0].finish_reason == "tool_calls"
        check_calls(response.choices[0].message)
    assert {c.function.name for c in named.choices[0].message.tool_calls} == {"get_time"}
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    message = auto.choices[0].message
    assert message.tool_calls is None or check_calls(message)
    single = ask(client, "required", parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_tool_choice_none_shows_no_tools(client):
    """Without tools in the prompt, tool_choice none answers as a request without tools does."""
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert answer(ask(client, "none", max_tokens=24)) == answer(plain)


def test_n_choices_and_logprobs(client):
    response = ask(client, NAMED, n=2, logprobs=True, top_logprobs=2)
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        check_calls(choice.message)
        assert "".join(e.token for e in choice.logprobs.content).startswith('{"tool_calls":[{"name":"get_time"')
    ids = [call.id for c in response.choices for call in c.message.tool_calls]
    assert len(set(ids)) == len(ids)


def test_strict_tools_parse_through_the_client_helper(client):
    class GetTime(BaseModel):
        zone: Literal["utc", "cet"]

    tool = openai.pydantic_function_tool(GetTime, name="get_time")
    parsed = client.chat.completions.parse(model=MODEL, messages=QUESTION, tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=80)
    [call] = parsed.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetTime)


def test_arguments_hold_only_declared_keys(client):
    """A schema that says nothing of other keys holds a call to its own, even with the model pushed to add one (a
    logit_bias on `,` after the first property); the same schema with additionalProperties true lets it add one."""
    comma = str(make_tokenizer(JSON_CHARS).convert_tokens_to_ids(","))
    zone = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
    for schema, extra_key in ((zone, False), ({**zone, "additionalProperties": True}, True)):
        tools = [{"type": "function", "function": {"name": "get_time", "parameters": schema}}]
        response = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, tool_choice=NAMED,
                                                  temperature=0, max_tokens=120, logit_bias={comma: 100},
                                                  parallel_tool_calls=False)  # else "," adds calls
        [call] = response.choices[0].message.tool_calls
        if extra_key:
            assert call.function.arguments.startswith(('{"zone":"utc",', '{"zone":"cet",')), call.function.arguments
        else:
            assert response.choices[0].finish_reason == "tool_calls"
            assert list(json.loads(call.function.arguments)) == ["zone"]


# -- exact under speculation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["auto", "required", "named", "none"])
def test_speculation_changes_nothing_greedy(client, choice):
    choice = NAMED if choice == "named" else choice
    alone = answer(ask(client, choice, speculative=SPEC_OFF, max_tokens=80))
    for drafter in ("draft", "ngram", "cascade"):
        for k in (1, 4):
            spec = {"draft_tokens": k} if drafter == "draft" else {"draft_model": drafter, "draft_tokens": k}
            assert answer(ask(client, choice, speculative=spec, max_tokens=80)) == alone, (drafter, k)
    assert answer(streamed(client, choice, speculative={"draft_tokens": 4}, max_tokens=80)) == alone


def test_forced_text_is_drafted(client):
    """The grammar's forced tokens (`{"tool_calls":[{"name":"get_time","arguments":{"zone":"`) are drafted and
    accepted: far fewer rounds than tokens."""
    response = ask(client, NAMED, speculative={"draft_tokens": 4})
    metrics = response.model_extra["speculative_metrics"]
    assert metrics["accepted_tokens"] >= len('{"tool_calls":[{"name":"get_time","arguments":{"zone":"')
    assert metrics["rounds"] < response.usage.completion_tokens / 2


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_coupled_seeded_sampling_is_the_target_alone(client, choice):
    texts = set()
    for seed in (1, 2, 3):
        sampled = dict(temperature=1.0, seed=seed, max_tokens=60)
        alone = answer(ask(client, choice, speculative={"enabled": False, "coupling": "gumbel"}, **sampled))
        for spec in ({"draft_tokens": 3}, {"draft_model": "ngram", "draft_tokens": 5}, {"adaptive": True}):
            assert answer(ask(client, choice, speculative={**spec, "coupling": "gumbel"}, **sampled)) == alone
        assert answer(streamed(client, choice, speculative={"coupling": "gumbel"}, **sampled)) == alone
        texts.add(json.dumps(alone))
        for finish, _, calls in alone:
            if finish == "tool_calls":
                for name, arguments in calls:
                    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert len(texts) > 1  # sampling does sample


# -- the stream's chunks ---------------------------------------------------------------------------------------------


def test_stream_chunks_as_openai_sends_them(base_url):
    body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
            "max_tokens": 120, "stream": True}
    with httpx.Client(base_url=base_url, timeout=60) as http, http.stream("POST", "/v1/chat/completions",
                                                                          json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls", [])]
    starts = [d for d in deltas if "id" in d]
    assert starts and all(set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
                          and set(d["function"]) == {"name", "arguments"} for d in starts)
    assert [d["index"] for d in starts] == list(range(len(starts)))
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
               for d in deltas if "id" not in d)
    assert not any("content" in ch["delta"] and ch["delta"]["content"] for c in chunks for ch in c["choices"])
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["tool_calls"]
    for index in range(len(starts)):
        arguments = "".join(d["function"]["arguments"] for d in deltas if d["index"] == index)
        jsonschema.validate(json.loads(arguments), SCHEMAS[starts[index]["function"]["name"]])


# -- bad requests ----------------------------------------------------------------------------------------------------

BAD_SCHEMA = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "strng"}}}}}]
CALL_HISTORY = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "utc"}}}]}]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"tools": BAD_SCHEMA}, "tools.0.function.parameters"),
    ("/v1/chat/completions", {"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"messages": [*QUESTION, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
    ("/v1/chat/completions", {"tools": TOOLS, "messages": CALL_HISTORY},  # arguments must be a string
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", {"messages": [*QUESTION, {"role": "assistant", "content": [{"type": "image_url"}]}]},
     "messages.1.content"),
    ("/v1/completions", {"prompt": "x", "tools": TOOLS}, "tools"),
])
def test_bad_tools_get_openai_400s(base_url, path, body, param):
    base = {"model": MODEL, "messages": QUESTION} if path.endswith("chat/completions") else {"model": MODEL}
    r = httpx.post(f"{base_url}{path}", json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


# -- a template that renders tools (Hermes / Qwen2.5 style) ----------------------------------------------------------


@pytest.fixture(scope="module")
def hermes_client(tmp_path_factory, one_thread):
    tokenizer = make_tokenizer(JSON_CHARS + list("<>/|"))
    tokenizer.chat_template = HERMES_TEMPLATE
    dirs = save_pair(tmp_path_factory.mktemp("hermes_models"), tokenizer, (40, 20))
    with serve(dirs) as running:
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_hermes_template_calls(hermes_client):
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    for messages in (QUESTION, history):
        for choice in ("required", NAMED):
            one = dict(max_tokens=160, parallel_tool_calls=False)
            alone = ask(hermes_client, choice, messages, speculative=SPEC_OFF, **one)
            assert alone.choices[0].finish_reason == "tool_calls", alone.choices[0].message
            check_calls(alone.choices[0].message)
            assert answer(ask(hermes_client, choice, messages, **one)) == answer(alone)
            assert answer(streamed(hermes_client, choice, messages, **one)) == answer(alone)
    several = ask(hermes_client, "required", max_tokens=200).choices[0]  # parallel calls: each valid
    check_calls(several.message, cut=several.finish_reason == "length")


# -- `<tool_call>` as a special token (Qwen2.5-Coder's tokenizer) ----------------------------------------------------


@pytest.fixture(scope="module")
def special_client(tmp_path_factory, one_thread):
    """A Hermes template whose tokenizer holds `<tool_call>` and `</tool_call>` as special tokens, which decoding
    drops from the text."""
    tokenizer = special_tokenizer()
    dirs = save_pair(tmp_path_factory.mktemp("special_models"), tokenizer, (40, 20))
    with serve(dirs) as running:
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_calls_whose_markers_are_special_tokens(special_client):
    """Calls open with the special token (the grammar names it by id) and parse, whole and streamed, in every mode:
    under auto the model is pushed to the token with a logit_bias, and its call is read back as one."""
    opening = str(special_tokenizer().convert_tokens_to_ids("<tool_call>"))
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    for messages in (QUESTION, history):
        for choice, bias in (("required", None), (NAMED, None), ("auto", {opening: 100})):
            one = dict(max_tokens=160, parallel_tool_calls=False, logit_bias=bias)
            alone = ask(special_client, choice, messages, speculative=SPEC_OFF, **one)
            [c] = alone.choices
            assert c.finish_reason == "tool_calls" and c.message.content is None, c.message
            check_calls(c.message)
            assert answer(ask(special_client, choice, messages, **one)) == answer(alone)
            assert answer(streamed(special_client, choice, messages, **one)) == answer(alone)
    plain = ask(special_client, "auto", max_tokens=24, logit_bias={opening: -100}).choices[0]  # no call: text
    assert plain.message.tool_calls is None and "tool_call" not in plain.message.content


def progress_stream(base_url: str, body: dict, headers: dict) -> list[tuple[dict | None, str]]:
    """A stream with the failover reports (server/resume.py): [(the report in front of an event or None, the event's
    data line)]; a report with no event after it (text held back) is kept with an empty line."""
    out, report = [], None
    with httpx.Client(base_url=base_url, timeout=120) as http, http.stream(
            "POST", "/v1/chat/completions", json=body, headers={PROGRESS_HEADER: "1", **headers}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(": vs "):
                if report is not None:
                    out.append((report, ""))
                report = json.loads(line[5:])
            elif line.startswith("data: "):
                out.append((report, line))
                report = None
    return out


def test_a_resumed_stream_keeps_its_special_markers(special_client):
    """A tool-call stream picked up by another replica (failover) from any point, the `<tool_call>` token among the
    tokens already streamed, adds up to the stream that was never cut."""
    base_url = str(special_client.base_url).removesuffix("/v1/")
    body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "tool_choice": NAMED, "temperature": 0,
            "max_tokens": 160, "parallel_tool_calls": False, "stream": True, "speculative": SPEC_OFF}

    def message(lines: list[str]):
        state = ChatCompletionStreamState(input_tools=TOOLS)
        for line in lines:
            if line.startswith("data: {"):
                state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate_json(line[6:]))
        return answer(state.current_completion_snapshot)

    whole = progress_stream(base_url, body, {})
    first = json.loads(whole[0][1][6:])
    expected = message([line for _, line in whole])
    assert expected[0][0] == "tool_calls" and expected[0][2]
    reported = [i for i, (report, _) in enumerate(whole) if report is not None and report.get("t")]
    for cut in reported[:-1]:
        tokens = [t for report, _ in whole[:cut + 1] if report is not None for t in report.get("t", [])]
        resume = {"id": first["id"], "created": first["created"], "tokens": tokens, "shown": whole[cut][0]["s"]}
        rest = progress_stream(base_url, body, {RESUME_HEADER: json.dumps(resume)})
        assert message([line for _, line in whole[:cut + 1] + rest]) == expected, cut


# -- a call cut by max_tokens, and sent back -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_call_cut_by_max_tokens_and_sent_back(client, special_client, stream):
    """A call cut by max_tokens comes as OpenAI sends it: finish_reason length, the call in tool_calls with its
    arguments cut (not valid JSON), which the official client reads without error (whole, and through its stream
    state); sent back as it came in the next request's history (an agent loop), it is accepted."""
    written = {"generic": '{"tool_calls":[{"name":"get_time","arguments":{"zone":"',
               "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "'}  # <tool_call>: one token
    for server, text, arguments in ((client, written["generic"], '{"zone":"'),
                                    (special_client, written["hermes"], '{"zone": "')):
        cut = len(text) - (len("<tool_call>") - 1 if server is special_client else 0)
        first = (streamed if stream else ask)(server, NAMED, max_tokens=cut)
        [c] = first.choices
        assert c.finish_reason == "length" and c.message.content is None
        [call] = c.message.tool_calls
        assert call.function.name == "get_time" and call.function.arguments == arguments
        messages = [*QUESTION, c.message, {"role": "tool", "tool_call_id": call.id, "content": "cut"}]
        again = ask(server, "auto", messages, max_tokens=8)
        assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Cut before the name is complete: no call yet, the text is the content.
    early = ask(client, NAMED, max_tokens=len('{"tool_calls":[{"name":"get'))
    assert early.choices[0].message.tool_calls is None
    assert early.choices[0].message.content == '{"tool_calls":[{"name":"get'


def test_history_as_openai_accepts_it(client, special_client):
    """Assistant messages with content null beside calls, content as a list of text (and refusal) parts, and call
    arguments that are any string: 200s."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}
    histories = [
        [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_1", "content": "noon"}],
        [*QUESTION, {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [
            {**call, "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "noon"}]}],
        [*QUESTION, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
         {"role": "user", "content": [{"type": "text", "text": "try"}, {"type": "text", "text": " again"}]}],
    ]
    for server in (client, special_client):
        for messages in histories:
            response = ask(server, "auto", messages, max_tokens=8)
            assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


# -- the real model (slow) -------------------------------------------------------------------------------------------

REAL_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 40},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer"}, "b": {"type": "integer"}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
]
REAL_PROMPTS = ["What is the weather in Paris?", "What is 17 plus 25?", "Is it raining in Tokyo right now?"]


@pytest.mark.slow
def test_real_default_model_calls_tools():
    """The embedded SmolLM2-135M target (generic format) with its default drafter: every call parses and validates
    against its function's schema, tool_choice is honoured, and speculation changes nothing."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in REAL_TOOLS}
    from verispec.runtime.model.loading import SMOLLM2_DRAFTER, SMOLLM2_TARGET

    config = ServerConfig(model=SMOLLM2_TARGET, draft_model=SMOLLM2_DRAFTER, enable_speculative=True, max_len=2048)
    with ServerThread(create_app(config)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=300)
        for prompt in REAL_PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            for choice in ("auto", "required", {"type": "function", "function": {"name": "add"}}, "none"):
                def call(speculative):
                    return client.chat.completions.create(
                        model=client.models.list().data[0].id, messages=messages, tools=REAL_TOOLS,
                        tool_choice=choice, temperature=0, max_tokens=64, extra_body={"speculative": speculative})
                on, off = call({"enabled": True}), call(SPEC_OFF)
                assert answer(on) == answer(off), (prompt, choice)
                message = on.choices[0].message
                if choice == "none":
                    assert message.tool_calls is None
                    continue
                if choice != "auto":
                    assert message.tool_calls, (prompt, choice, message)
                for tool_call in message.tool_calls or ():
                    assert tool_call.function.name in schemas
                    if isinstance(choice, dict):
                        assert tool_call.function.name == "add"
                    if on.choices[0].finish_reason == "tool_calls":
                        jsonschema.validate(json.loads(tool_call.function.arguments), schemas[tool_call.function.name])
