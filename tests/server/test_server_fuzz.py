"""The server under fuzzing: schemathesis against its own OpenAPI schema, and every malformed request we could
think of. Whatever arrives, the answer is a documented status below 500 with a schema-valid body, and the server
answers the next request correctly.

The fuzz runs against a real uvicorn server (API key on, as it would be exposed) with Hypothesis derandomized, so
a run is reproducible. VERISPEC_FUZZ_EXAMPLES sets the examples per operation and generation mode (default 150:
over 1,000 requests, under a minute on two cores); VERISPEC_FUZZ_REPORT=path writes the status histogram as JSON.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections import Counter

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from test_server import MODEL, ServerThread
from test_server_batching import idle
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("VERISPEC_FUZZ_EXAMPLES", "150"))
MAX_TOKENS = 8  # what the fuzzed schema allows a request to ask for, so each generation is short
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


@pytest.fixture(scope="module")
def server(model_dirs):
    config = ServerConfig(
        model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]), enable_speculative=True,
        spec=SpeculativeConfig(num_draft_tokens=3), max_len=128, max_num_seqs=8, api_key=KEY,
    )
    app = create_app(config)
    with ServerThread(app) as running:
        running.app = app
        yield running


def fuzzed_schema(app) -> schemathesis.BaseSchema:
    """The app's own schema, with max_tokens required and bounded, and n bounded (negative examples still go past
    the bounds)."""
    raw = copy.deepcopy(app.openapi())
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        body = raw["components"]["schemas"][name]
        body["required"] = [*body.get("required", []), "max_tokens"]  # else chat runs to the end of the context
        fields = body["properties"]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in fields:
                for option in fields[field].get("anyOf", [fields[field]]):
                    if option.get("type") == "integer":
                        option["maximum"] = MAX_TOKENS
        fields["n"]["maximum"] = 2
    return schemathesis.openapi.from_dict(raw)


@pytest.mark.fuzz
def test_fuzzed_requests_never_get_a_server_error(server):
    statuses: Counter[int] = Counter()
    schema = fuzzed_schema(server.app)
    started = time.perf_counter()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            def run(case):
                response = case.call(base_url=server.url, headers=AUTH, timeout=60)
                statuses[response.status_code] += 1
                case.validate_response(response, checks=CHECKS)

            try:
                run()
            except Unsatisfiable:  # no parameters to break (GET /health): no negative example exists
                assert mode is GenerationMode.NEGATIVE, operation.label
    report = {"requests": sum(statuses.values()), "seconds": round(time.perf_counter() - started, 1),
              "statuses": {str(k): v for k, v in sorted(statuses.items())}}
    if os.environ.get("VERISPEC_FUZZ_REPORT"):
        with open(os.environ["VERISPEC_FUZZ_REPORT"], "w") as f:
            json.dump(report, f, indent=1)
    print(f"fuzz: {report}")
    assert max(statuses) < 500, report
    assert statuses[200] > 0 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 0, report
    assert_serves(server)


def assert_serves(server) -> None:
    """The next request gets the right answer, and nothing is left queued or running."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    first = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=12, temperature=0)
    again = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=12, temperature=0,
                                      extra_body={"speculative": False})
    assert first.choices[0].text == again.choices[0].text and first.usage.completion_tokens > 0
    idle(server)


# -- malformed requests, by hand -----------------------------------------------------------------------------------

MB = 2**20
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
NESTED = b"[" * 50_000 + b"]" * 50_000


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "the cat", "max_tokens": 4, **fields}


def text_body(text: str) -> bytes:
    """JSON as a client may really send it: escapes (lone surrogates, NaN literals) written out."""
    return text.encode()


MALFORMED = {
    # not JSON, or not an object
    "truncated": (CHAT, b'{"model": "target", "messages": ['),
    "trailing comma": (COMPLETIONS, b'{"prompt": "x",}'),
    "two objects": (COMPLETIONS, b'{"prompt": "x"}{"prompt": "y"}'),
    "empty body": (COMPLETIONS, b""),
    "null": (COMPLETIONS, b"null"),
    "number": (COMPLETIONS, b"123"),
    "string": (CHAT, b'"hello"'),
    "array": (CHAT, b"[]"),
    "invalid utf-8": (COMPLETIONS, b'{"prompt": "\xff\xfe"}'),
    "utf-8 bom": (COMPLETIONS, b"\xef\xbb\xbf" + json.dumps(completion()).encode()),
    "deeply nested": (COMPLETIONS, NESTED),
    "nested prompt": (COMPLETIONS, b'{"prompt": ' + NESTED + b"}"),
    # wrong types
    "prompt object": (COMPLETIONS, completion(prompt={"text": "x"})),
    "messages object": (CHAT, chat(messages={"role": "user"})),
    "content image": (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])),
    "n string": (COMPLETIONS, completion(n="2")),
    "n float": (COMPLETIONS, completion(n=2.0)),
    "max_tokens bool": (COMPLETIONS, completion(max_tokens=True)),
    "stream string": (CHAT, chat(stream="yes")),
    "stop number": (COMPLETIONS, completion(stop=5)),
    "stop ids strings": (COMPLETIONS, completion(stop_token_ids=["a"])),
    "seed float": (COMPLETIONS, completion(seed=1.5)),
    "speculative string": (COMPLETIONS, completion(speculative="yes")),
    "draft_tokens string": (COMPLETIONS, completion(speculative={"draft_tokens": "3"})),
    "stream_options list": (CHAT, chat(stream=True, stream_options=[1])),
    # huge and non-finite numbers
    "max_tokens 1e30": (COMPLETIONS, completion(max_tokens=10**30)),
    "n 1e30": (COMPLETIONS, completion(n=10**30)),
    "seed 1e30": (COMPLETIONS, completion(seed=10**30)),
    "top_k 1e30": (COMPLETIONS, completion(top_k=10**30)),
    "min_tokens 1e30": (CHAT, {**chat(min_tokens=10**30), "max_tokens": None}),
    "temperature 1e308": (COMPLETIONS, completion(temperature=1e308)),
    "repetition_penalty 1e308": (COMPLETIONS, completion(repetition_penalty=1e308, max_tokens=3)),
    "repetition_penalty tiny": (COMPLETIONS, completion(repetition_penalty=1e-308, max_tokens=3)),
    "stop id 1e30": (COMPLETIONS, completion(stop_token_ids=[10**30])),
    "stop id negative": (COMPLETIONS, completion(stop_token_ids=[-1])),
    "prompt id 1e30": (COMPLETIONS, completion(prompt=[10**30])),
    "prompt id negative": (COMPLETIONS, completion(prompt=[[-1]])),
    "draft_tokens 1e30": (COMPLETIONS, completion(speculative={"draft_tokens": 10**30})),
    "float 1e999": (COMPLETIONS, text_body('{"prompt": "x", "temperature": 1e999}')),
    "NaN": (COMPLETIONS, text_body('{"prompt": "x", "temperature": NaN}')),
    "Infinity": (COMPLETIONS, text_body('{"prompt": "x", "repetition_penalty": Infinity}')),
    "-Infinity top_p": (CHAT, text_body('{"messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}')),
    "n 64 x 2 prompts": (COMPLETIONS, completion(prompt=["a", "b"], n=64)),
    "17 stop strings": (COMPLETIONS, completion(stop=["x"] * 17)),
    "long stop string": (COMPLETIONS, completion(stop="x" * 257)),
    "17 stop ids": (COMPLETIONS, completion(stop_token_ids=[1] * 17)),
    # unicode edge cases
    "lone surrogate prompt": (COMPLETIONS, text_body('{"prompt": "a\\ud800b", "max_tokens": 2}')),
    "lone surrogate chat": (CHAT, text_body('{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}')),
    "lone surrogate model": (COMPLETIONS, text_body('{"model": "\\ud800", "prompt": "x"}')),
    "lone surrogate stop": (COMPLETIONS, text_body('{"prompt": "x", "stop": "\\ud800", "max_tokens": 2}')),
    "lone surrogate drafter": (COMPLETIONS, text_body('{"prompt": "x", "speculative": {"draft_model": "\\ud800"}}')),
    "NUL and controls": (COMPLETIONS, completion(prompt="a\u0000b\u0007\u001b[31m", stop="\u0000")),
    "RTL override, zero width": (CHAT, chat(messages=[{"role": "user", "content": "\u202eabc\u200b\ufeff"}])),
    "astral and combining": (COMPLETIONS, completion(prompt="\U0001f600\u0301\U0010ffff\uffff" * 10)),
    "unicode model name": (COMPLETIONS, completion(model="\u043c\u043e\u0434\u0435\u043b\u044c")),
    "unicode role": (CHAT, chat(messages=[{"role": "\u0075ser\u0301", "content": "x"}])),
    # unknown fields are ignored, as OpenAI clients send many
    "unknown fields": (COMPLETIONS, completion(foo={"bar": [1, 2]}, logit_bias_extra=1, functions=[])),
    "unknown speculative field": (COMPLETIONS, completion(speculative={"enabled": False, "tree": True})),
    # drafters named by path, or not allowed
    "drafter ../": (COMPLETIONS, completion(speculative={"draft_model": "../../etc/passwd"})),
    "drafter /etc": (COMPLETIONS, completion(speculative={"draft_model": "/etc"})),
    "drafter ~": (COMPLETIONS, completion(speculative={"draft_model": "~/.cache/huggingface"})),
    "drafter ./": (COMPLETIONS, completion(speculative={"draft_model": "./draft"})),
    "drafter file url": (COMPLETIONS, completion(speculative={"draft_model": "file:///etc/passwd"})),
    "drafter windows": (COMPLETIONS, completion(speculative={"draft_model": "C:\\models\\draft"})),
    "drafter cascade": (COMPLETIONS, completion(speculative={"draft_model": "ngram+/tmp/draft"})),
    "drafter hub id": (COMPLETIONS, completion(speculative={"draft_model": "HuggingFaceTB/SmolLM2-135M"})),
    "drafter random": (COMPLETIONS, completion(speculative={"draft_model": "random"})),
    "empty drafter, the default": (COMPLETIONS, completion(speculative={"draft_model": ""})),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_requests_get_a_client_error(server, case):
    path, body = MALFORMED[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as http:
        r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert r.status_code in (400, 404) and error["message"] and error["type"] == "invalid_request_error", r.text
    if case.startswith("drafter"):
        assert r.status_code == 400 and "--allowed-draft-models" in r.json()["error"]["message"]


def big_body(size: int) -> bytes:
    return json.dumps(completion(prompt="x" * size)).encode()


@pytest.mark.parametrize("how", ["content-length", "chunked"])
def test_a_20_mb_body_gets_413_and_the_server_keeps_serving(server, how):
    body = big_body(20 * MB)
    content = body if how == "content-length" else (body[i : i + MB] for i in range(0, len(body), MB))
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as http:
        r = http.post(COMPLETIONS, content=content, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        assert http.post(COMPLETIONS, json=completion()).status_code == 200
    assert_serves(server)


def test_other_methods_paths_and_headers(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as http:
        assert http.get(COMPLETIONS).status_code == 405
        assert http.delete("/v1/models").status_code == 405
        assert http.get("/v1/models/" + "a" * 5000).status_code == 404
        assert http.get("/v1/models/%2e%2e%2f%2e%2e%2fetc").status_code == 404
        assert http.post(COMPLETIONS, content=json.dumps(completion()), headers={"content-type": "text/plain"}
                         ).status_code == 400
        r = http.post(COMPLETIONS, json=completion(), headers={"X-Junk": b"\xff" * 1000})
        assert r.status_code == 200
    assert_serves(server)
