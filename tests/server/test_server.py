"""The OpenAI-compatible server, end to end: a real uvicorn server on 127.0.0.1 driven by the `openai` client.

One app (tiny trained target + draft from `model_dirs`, speculation on by default) serves every test in this
module; the last test starts `verispec serve` as a subprocess (speculation off by default).
"""

from __future__ import annotations

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from gates import EventReader, StepGate
from verispec.cli import main as cli_main
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app

MODEL = "target"  # the served model's id: the target folder's name
MAX_LEN = 512
SPEC_ON = {"speculative": {"enabled": True}}
SPEC_OFF = {"speculative": {"enabled": False}}


class ServerThread:
    """uvicorn on a free port of 127.0.0.1, in a background thread (bound before it starts: no port race)."""

    def __init__(self, app) -> None:
        # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say so, and with it on,
        # every response after a connection's first waits ~40 ms for the client's delayed ACK.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "uvicorn did not shut down"


@pytest.fixture(scope="module")
def one_torch_thread(model_dirs):
    # Two cores shared with other jobs: several OpenMP threads per tiny matmul only wait on each other.
    # (After model_dirs: the shared fixtures are built the same way whichever module asks first.)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def running(model_dirs, one_torch_thread):
    config = ServerConfig(
        model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]), enable_speculative=True,
        spec=SpeculativeConfig(num_draft_tokens=4), max_len=MAX_LEN,
        allowed_draft_models=("ngram", str(model_dirs["target"]), f"odd={model_dirs['odd_vocab']}",
                              "missing=/no/such/model", "self:int8"),
    )
    app = create_app(config)
    with ServerThread(app) as running:
        running.app = app
        yield running


@pytest.fixture(scope="module")
def base_url(running):
    return running.url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


def complete(client, prompt="the cat sat", max_tokens=16, **extra):
    """A text completion; `extra` goes to the body as is (sampling fields, `speculative`, `ignore_eos`)."""
    fields = {k: extra.pop(k) for k in ("temperature", "seed", "stop", "n") if k in extra}
    fields.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, extra_body=extra, **fields)


def spec_metrics(response) -> dict:
    return response.model_extra["speculative_metrics"]


def scrape(http) -> dict[str, float]:
    """/metrics as {'name{label="v",...}': value}."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return error


# -- the basics -------------------------------------------------------------------------------------------------------


def test_health_and_models(http, client, model_dirs):
    assert http.get("/health").json() == {"status": "ok", "model": MODEL}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    # The target path given at start-up names the same model.
    r = complete(client, prompt="one two", max_tokens=4)
    assert r.model == MODEL
    assert client.completions.create(model=str(model_dirs["target"]), prompt="one two", max_tokens=4).model == MODEL


def test_chat_completion(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "the dog"}],
        max_completion_tokens=12, temperature=0, user="tester", extra_body={"unknown_field": [1, 2]},
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert abs(r.created - time.time()) < 120
    [choice] = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    metrics = spec_metrics(r)
    assert metrics["enabled"] and metrics["num_draft_tokens"] == 4 and metrics["draft_tokens"] > 0
    assert not metrics["adaptive"] and metrics["acceptance_mode"] == "exact" and not metrics["lossy"]
    assert set(metrics) >= {"draft_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "draft_ms",
                            "verify_ms", "rounds", "acceptance_by_position"}


def test_completion_schema_and_n(client):
    r = complete(client, prompt="Paris is the", max_tokens=10, n=2, ignore_eos=True)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text  # greedy: n identical choices
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 20  # prompt counted once, completions summed


# -- per-request speculation ----------------------------------------------------------------------------------------


def test_speculation_on_off_gives_identical_greedy_output(client):
    on = complete(client, max_tokens=24, ignore_eos=True, **SPEC_ON)
    off = complete(client, max_tokens=24, ignore_eos=True, **SPEC_OFF)
    default = complete(client, max_tokens=24, ignore_eos=True)  # the server speculates by default
    assert on.choices[0].text == off.choices[0].text == default.choices[0].text
    m_on, m_off = spec_metrics(on), spec_metrics(off)
    assert m_on["enabled"] and m_on["draft_tokens"] > 0 and m_on["accepted_tokens"] > 0
    assert m_on["rounds"] < 24 and m_on["mean_accepted_length"] > 1
    assert not m_off["enabled"] and m_off["draft_tokens"] == 0 and m_off["accepted_tokens"] == 0
    assert m_off["rounds"] == 24 and m_off["acceptance_by_position"] == []
    assert spec_metrics(default)["draft_tokens"] > 0


def test_draft_tokens_per_request(client):
    texts = set()
    for k in (1, 6):
        r = complete(client, prompt="one two three", max_tokens=20, ignore_eos=True, speculative={"draft_tokens": k})
        m = spec_metrics(r)
        assert m["num_draft_tokens"] == k and len(m["acceptance_by_position"]) == k
        assert m["draft_tokens"] <= k * m["rounds"]
        texts.add(r.choices[0].text)
    assert len(texts) == 1


def test_other_drafter_per_request(client, model_dirs, base_url):
    # The target itself as drafter: under greedy verification every draft token is accepted.
    r = complete(client, max_tokens=16, ignore_eos=True, speculative={"draft_model": str(model_dirs["target"])})
    m = spec_metrics(r)
    assert m["draft_model"] == str(model_dirs["target"]) and m["acceptance_rate"] == 1.0
    assert r.choices[0].text == complete(client, max_tokens=16, ignore_eos=True, **SPEC_OFF).choices[0].text
    none = complete(client, max_tokens=4, speculative={"enabled": True, "draft_model": "none"})
    assert not spec_metrics(none)["enabled"] and spec_metrics(none)["draft_tokens"] == 0


def test_the_targets_twin_per_request(client):
    """`"speculative": {"draft_model": "self:int8"}`: the target's own quantized twin, built on first use."""
    r = complete(client, max_tokens=16, ignore_eos=True, speculative={"draft_model": "self:int8"})
    m = spec_metrics(r)
    assert m["draft_model"] == "self:int8" and m["accepted_tokens"] > 0
    assert r.choices[0].text == complete(client, max_tokens=16, ignore_eos=True, **SPEC_OFF).choices[0].text


def test_which_requests_speculate_and_how():
    """Server.speculation alone: the server's defaults, what a request may change, and fixed K where it matters."""
    from types import SimpleNamespace

    from verispec.config import SamplingParams
    from verispec.server.app import Server
    from verispec.server.protocol import SpeculativeOptions

    def decide(enable: bool, option=None, **sampling):
        config = ServerConfig(model="t", draft_model="d", enable_speculative=enable)
        server = Server(config, SimpleNamespace(spec=SpeculativeConfig(num_draft_tokens=4, adaptive=True)))
        if isinstance(option, dict):
            option = SpeculativeOptions(**option)
        spec, drafter = server.speculation(option, SamplingParams(**sampling))
        return drafter, spec.adaptive, spec.num_draft_tokens

    assert decide(True) == ("d", True, 4)
    assert decide(False) == (None, True, 4)
    assert decide(True, False) == (None, True, 4)
    assert decide(False, True) == ("d", True, 4)
    assert decide(False, {"draft_tokens": 2}) == ("d", False, 2)  # asking for a K turns speculation on, K fixed
    assert decide(True, {"draft_model": "none"})[0] is None
    assert decide(False, {"draft_model": "ngram"})[0] == "ngram"
    assert decide(True, temperature=0.7, seed=1, coupled=False) == ("d", False, 4)  # seeded rejection: fixed K
    assert decide(True, temperature=0.7, seed=1) == ("d", True, 4)  # seeded: coupled by default, K-independent
    assert decide(True, temperature=0.7) == ("d", True, 4)
    assert decide(True, seed=1) == ("d", True, 4)  # greedy: K never changes the output
    assert decide(True, {"adaptive": True}, temperature=0.7, seed=1) == ("d", True, 4)


# -- sampling, stop strings, streaming ------------------------------------------------------------------------------


def test_stop_strings(client):
    full = complete(client, max_tokens=24, ignore_eos=True).choices[0].text
    stop = full[8:11]
    expected = full[: full.index(stop)]
    for stops in (stop, ["never-there", stop]):
        r = complete(client, max_tokens=24, ignore_eos=True, stop=stops)
        assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=24, temperature=0, stop=stop,
                                         stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    def sample(seed, **extra):
        return complete(client, prompt="a bird", max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True, **extra)

    for spec in (SPEC_ON, SPEC_OFF):
        assert sample(7, **spec).choices[0].text == sample(7, **spec).choices[0].text
    # A seed couples by default: speculation on gives the target alone's tokens, with adaptive K.
    assert sample(7, **SPEC_ON).choices[0].text == sample(7, **SPEC_OFF).choices[0].text
    texts = {sample(seed, **SPEC_OFF).choices[0].text for seed in range(7, 11)}
    assert len(texts) > 1  # sampling does sample
    # n > 1 runs choice i with seed + i.
    both = sample(7, n=2, **SPEC_OFF)
    assert [c.text for c in both.choices] == [sample(7, **SPEC_OFF).choices[0].text,
                                              sample(8, **SPEC_OFF).choices[0].text]


def test_streaming_chat_with_usage(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "the cat"}], max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert len(content) > 1  # text arrives round by round, not at the end
    assert "".join(content) == whole.choices[0].message.content
    *_, finish, usage = chunks
    assert finish.choices[0].finish_reason == "length" and finish.model_extra["speculative_metrics"]["rounds"] > 0
    assert usage.choices == [] and usage.usage.completion_tokens == 20
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.model_extra["speculative_metrics"]["draft_tokens"] > 0


def test_streaming_wire_format(http):
    body = {"model": MODEL, "prompt": "one two", "max_tokens": 8, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert '"object":"text_completion"' in events[0] and '"usage"' not in "".join(events)


# -- concurrency ------------------------------------------------------------------------------------------------------


def test_concurrent_clients_get_their_solo_outputs(client):
    requests = [
        dict(prompt="the cat sat", max_tokens=24, ignore_eos=True),
        dict(prompt="one two three", max_tokens=24, ignore_eos=True, **SPEC_OFF),
        dict(prompt="Paris is the", max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
        dict(prompt="the dog", max_tokens=24, temperature=1.0, seed=4, ignore_eos=True, **SPEC_OFF),
        dict(prompt="Rome is", max_tokens=24, ignore_eos=True, speculative={"draft_tokens": 2}),
        dict(prompt="a bird sang", max_tokens=24, temperature=0.7, seed=5, top_k=8, ignore_eos=True),
    ]
    solo = [complete(client, **dict(r)).choices[0].text for r in requests]
    barrier = threading.Barrier(len(requests))
    results: list[str | None] = [None] * len(requests)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = complete(client, **dict(requests[i])).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == solo


# -- errors -----------------------------------------------------------------------------------------------------------


ERROR_CASES = [
    ("/v1/chat/completions", b'{"model": "target", "messages": [', 400, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages.0.role"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "16"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**12}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "the cat " * 70, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": {"draft_tokens": 0}}, 400,
     "speculative.draft_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": {"draft_tokens": 65}}, 400,
     "speculative.draft_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": {"draft_model": "/no/such/model"}}, 400,
     "speculative.draft_model"),  # not on --allowed-draft-models
    ("/v1/completions", {"model": MODEL, "prompt": "x", "speculative": {"draft_model": "missing"}}, 404,
     "speculative.draft_model"),  # allowed, but its model is not there
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"cat": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"7": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "custom", "custom": {"name": "f"}}]}, 400, "tools.0.type"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "echo": True}, 400,
     "echo"),  # echo is text completions' (tests/server/test_server_echo.py)
    ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "(unclosed"}, 400, "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "guided_choice"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "response_format": {"type": "json_schema"}}, 400,
     "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_choice": ["a"], "ignore_eos": True}, 400,
     "ignore_eos"),
    ("/v1/completions", [{"prompt": "x"}], 400, None),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "x"}, 404, "model"),
    ("/v1/models/gpt-4o", None, 404, "model"),
    ("/v1/nowhere", None, 404, None),
]


@pytest.mark.parametrize("path, body, status, param", ERROR_CASES, ids=[f"{i}" for i in range(len(ERROR_CASES))])
def test_bad_requests_get_openai_errors(http, path, body, status, param):
    if body is None:
        r = http.get(path)
    elif isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    error = assert_error(r, status, param)
    if status == 404 and param == "model":
        assert error["code"] == "model_not_found"
    assert http.get("/health").status_code == 200


def test_errors_through_the_client_and_server_keeps_serving(client, model_dirs):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, speculative={"draft_model": "odd"})
    assert info.value.body["param"] == "speculative.draft_model"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert complete(client, max_tokens=4).choices[0].text


# -- disconnects and metrics ------------------------------------------------------------------------------------------


def test_client_disconnect_stops_generation(http, client, running, monkeypatch):
    before = scrape(http)
    gate = StepGate(monkeypatch, running.app.state.server.worker.engine)
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": MAX_LEN - 10, "ignore_eos": True, "temperature": 0,
            "stream": True, **SPEC_OFF}
    gate.hold()  # however fast the machine, the generation cannot end before the client leaves
    with httpx.Client(base_url=str(http.base_url), timeout=60) as own:
        with own.stream("POST", "/v1/completions", json=body) as r:  # taken by the idle worker, held before a step
            events = EventReader(r)
            gate.advance_until(lambda: events.has(1))
    assert '"text_completion"' in events.events[0]
    cancelled = 'verispec_generations_total{outcome="cancelled",speculative="false"}'
    gate.release()  # the leaving is seen when the next event cannot be sent: after a step, long before the last
    deadline = time.monotonic() + 30
    while (after := scrape(http)).get(cancelled, 0) <= before.get(cancelled, 0):
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    generated = after["verispec_generated_tokens_total"] - before["verispec_generated_tokens_total"]
    assert generated < MAX_LEN - 10
    assert complete(client, max_tokens=4).choices[0].text  # the worker is free again


def test_metrics_move(http, client):
    before = scrape(http)
    r = complete(client, max_tokens=12, ignore_eos=True)
    after = scrape(http)

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    m = spec_metrics(r)
    assert moved('verispec_requests_total{endpoint="/v1/completions",status="200"}') == 1
    assert moved("verispec_prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("verispec_generated_tokens_total") == 12
    assert moved("verispec_rounds_total") == m["rounds"]
    assert moved("verispec_draft_tokens_total") == m["draft_tokens"] > 0
    assert moved("verispec_accepted_tokens_total") == m["accepted_tokens"]
    for kind in ("draft", "accepted"):
        by_position = [moved(f'verispec_{kind}_tokens_by_position_total{{position="{i}"}}') for i in range(4)]
        assert sum(by_position) == m[f"{kind}_tokens"]
    assert "verispec_fallbacks_total" in after
    assert moved("verispec_time_to_first_token_seconds_count") == 1
    assert moved("verispec_time_per_output_token_seconds_count") == 1
    assert moved('verispec_request_duration_seconds_count{endpoint="/v1/completions"}') == 1
    # Gauges: the worker may still be between its last event and lowering them (the queued test waits for 0).
    assert "verispec_queued_requests" in after and "verispec_running_requests" in after


# -- the command line -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--draft-tokens", "0"],
    ["--speculative-threshold", "1.5"],
    ["--port", "70000"],
    ["--max-len", "0"],
    ["--allowed-draft-models", ","],
    ["--allowed-draft-models", "a=x,a=y"],
    ["--max-queued-requests", "0"],
    ["--request-timeout", "-1"],
    ["--max-request-bytes", "10"],
    ["--max-choices", "65"],
    ["--shutdown-timeout", "-1"],
    ["--api-key", " "],
])
def test_serve_rejects_bad_flags(argv, model_dirs, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["serve", "--model", str(model_dirs["target"]), *argv])
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_serve_reports_a_taken_port(model_dirs, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            cli_main(["serve", "--model", str(model_dirs["target"]), "--port", str(port)])
    assert info.value.code == 2 and "pick another --port" in capsys.readouterr().err


def _verispec_command() -> list[str]:
    script = Path(sys.executable).with_name("verispec")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from verispec.cli import main; sys.exit(main())"]


def test_verispec_serve_subprocess(model_dirs):
    """`verispec serve` without --enable-speculative: target alone unless a request asks for speculation."""
    proc = subprocess.Popen(
        [*_verispec_command(), "serve", "--model", str(model_dirs["target"]), "--draft-model",
         str(model_dirs["draft"]), "--max-len", "256", "--port", "0", "--threads", "1", "--log-level", "warning"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        deadline = time.monotonic() + 90
        port = None
        while port is None:
            assert proc.poll() is None, f"verispec serve exited with {proc.returncode}"
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail("verispec serve did not start")
            if match := re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)/v1", line):
                port = int(match.group(1))
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            for _ in range(100):  # the line is printed just before uvicorn starts accepting
                try:
                    health = c.get("/health")
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            assert health.status_code == 200 and health.json()["model"] == MODEL
            body = {"model": MODEL, "prompt": "the cat", "max_tokens": 8, "temperature": 0}
            plain = c.post("/v1/completions", json=body).json()
            spec = c.post("/v1/completions", json={**body, "speculative": True}).json()
        assert plain["speculative_metrics"]["draft_tokens"] == 0
        assert spec["speculative_metrics"]["draft_tokens"] > 0
        assert plain["choices"][0]["text"] == spec["choices"][0]["text"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_real_default_pair_speculation_is_lossless():
    """The embedded SmolLM2 target (and the shipped draft, or the n-gram drafter while it is not built)."""
    from verispec.runtime.model.loading import SMOLLM2_DRAFT, ModelLoadError, resolve_model_path

    try:
        resolve_model_path(SMOLLM2_DRAFT)
        draft = SMOLLM2_DRAFT
    except ModelLoadError:
        draft = "ngram"
    config = ServerConfig(draft_model=draft, enable_speculative=True, max_len=1024,
                          spec=SpeculativeConfig(num_draft_tokens=4))
    with ServerThread(create_app(config)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "List the first five prime numbers, separated by commas."}]
        replies = [client.chat.completions.create(model=config.model_id, messages=messages, max_tokens=32,
                                                  temperature=0, extra_body=spec) for spec in (SPEC_ON, SPEC_OFF)]
    on, off = replies
    assert on.choices[0].message.content == off.choices[0].message.content
    assert spec_metrics(on)["draft_tokens"] > 0 and spec_metrics(off)["draft_tokens"] == 0
