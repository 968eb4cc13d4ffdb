"""A server you can expose: the API key, the drafters a request may name (and their memory), the request limits
(choices, stop strings, timeouts), the KV-memory guard, graceful shutdown on SIGTERM / SIGINT, the command-line
flags, and `SpeculativeGenerator(..., tokenizer=None)` with token-id prompts.
"""

from __future__ import annotations

import dataclasses
import queue
import re
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn

from gates import StepGate
from test_server import MODEL, ServerThread, _verispec_command, scrape
from test_server_batching import idle
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app, served as runtime
from verispec.server.shutdown import GracefulServer

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(model_dirs):
    config = ServerConfig(
        model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]), enable_speculative=True,
        spec=SpeculativeConfig(num_draft_tokens=3), max_len=256, api_key=KEY, max_choices=4, request_timeout=120.0,
        allowed_draft_models=("ngram", f"self={model_dirs['target']}", f"self2={model_dirs['target']}"),
        max_cached_drafters=1,
    )
    app = create_app(config)
    with ServerThread(app) as running:
        yield SimpleNamespace(url=running.url, app=app, worker=app.state.server.worker)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def complete(client, **fields):
    extra = {k: fields.pop(k) for k in ("speculative", "stop_token_ids", "ignore_eos") if k in fields}
    return client.completions.create(model=MODEL, temperature=0, **{"prompt": "the cat", "max_tokens": 8, **fields},
                                     extra_body=extra)


def error_of(info) -> dict:
    return info.value.body


# -- authentication ---------------------------------------------------------------------------------------------------


def test_every_v1_route_needs_the_key_and_probes_stay_open(server, client):
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", f"/v1/models/{MODEL}"), ("GET", "/v1/nowhere")):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):
                r = http.request(method, path, json=body if method == "POST" else None, headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.json()["error"]["type"] == "authentication_error"
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        ok = http.post("/v1/completions", json=body, headers={"Authorization": f"bearer  {KEY}"})
        assert ok.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == [MODEL]
    with httpx.Client(base_url=server.url) as http:
        assert scrape(http)['verispec_requests_total{endpoint="/v1/completions",status="401"}'] >= 4


def test_the_schema_says_which_routes_need_the_key(server):
    schema = server.app.openapi()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/health"]["get"]
    assert {"401", "408", "413", "429", "503"} <= set(schema["paths"]["/v1/completions"]["post"]["responses"])


# -- drafters a request may name --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../draft", "/etc", "~/.cache", "./draft", "ngram+self", "random", "auto",
                                  "self ", "SELF"])
def test_a_drafter_not_allowed_is_refused_naming_the_flag(client, name):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, speculative={"draft_model": name})
    error = error_of(info)
    assert error["param"] == "speculative.draft_model" and error["code"] == "draft_model_not_allowed"
    assert "--allowed-draft-models" in error["message"] and "`self`" in error["message"]


def test_allowed_drafters_by_name_and_a_bounded_cache(server, client, model_dirs):
    served = server.worker.served
    plain = complete(client, max_tokens=12, ignore_eos=True, speculative=False).choices[0].text
    for name in ("self", "self2", "ngram", str(model_dirs["draft"]), "none"):
        r = complete(client, max_tokens=12, ignore_eos=True, speculative={"draft_model": name})
        assert r.choices[0].text == plain
        metrics = r.model_extra["speculative_metrics"]
        assert metrics["draft_model"] == (None if name == "none" else name)  # the name, never the path behind it
    assert list(served._cache) == ["ngram"]  # max_cached_drafters=1: self and self2 were dropped in turn
    assert complete(client, speculative={"draft_model": "self"}).model_extra["speculative_metrics"][
        "acceptance_rate"] == 1.0  # the target drafting for itself


def test_a_drafter_that_does_not_fit_in_memory_is_refused(server, client, monkeypatch):
    served = server.worker.served
    complete(client, speculative={"draft_model": "ngram"})
    assert list(served._cache) == ["ngram"]
    monkeypatch.setattr(runtime, "free_memory_bytes", lambda device: 1024)
    with pytest.raises(openai.InternalServerError) as info:
        complete(client, speculative={"draft_model": "self"})
    assert info.value.status_code == 503 and error_of(info)["code"] == "insufficient_memory"
    assert "slots" in error_of(info)["message"]
    assert served._cache == {}  # the cache was emptied first, to make room
    monkeypatch.undo()
    assert complete(client, speculative={"draft_model": "self"}).choices[0].text


@pytest.mark.parametrize("allowed, message", [
    (("a=x", "a=y"), "given twice"),
    (("=x",), "has no name"),
])
def test_allowed_draft_models_are_checked_at_start(allowed, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(model="t", allowed_draft_models=allowed)


def test_default_allowed_drafters():
    assert ServerConfig(model="t", draft_model="d").draft_models == {"d": "d", "none": "none", "ngram": "ngram"}
    assert ServerConfig(model="t", draft_model="d", allowed_draft_models=("x=/p",)).draft_models == {
        "d": "d", "none": "none", "x": "/p"}


# -- request limits ---------------------------------------------------------------------------------------------------


def test_limits_on_choices_and_stop(client):
    cases = [
        (dict(n=5), "n", "--max-choices"),
        (dict(prompt=["a", "b", "c"], n=2), "n", "--max-choices"),
        (dict(stop=["x"] * 17), "stop", "at most 16"),
        (dict(stop="x" * 257), "stop", "at most 256"),
        (dict(stop_token_ids=list(range(17))), "stop_token_ids", "at most 16"),
        (dict(stop_token_ids=[10**6]), "stop_token_ids", "outside the vocabulary"),
        (dict(max_tokens=10**9), "prompt", "max_len"),
    ]
    for fields, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            complete(client, **fields)
        assert error_of(info)["param"] == param and words in error_of(info)["message"], error_of(info)
    assert len(complete(client, n=4, stop=["x"] * 16).choices) == 4


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_timeout_ends_with_an_error_and_frees_its_row(server, client, monkeypatch, stream):
    # Held: the idle worker takes each request, then no step runs, so none can finish before its 1 s deadline,
    # however fast the machine is; released, the timed-out row leaves. The 1 s deadline is this test's alone: the
    # module's server has a bound no other request could reach on a loaded machine (loading a draft model, say).
    served = server.worker.served
    monkeypatch.setattr(served, "config", dataclasses.replace(served.config, request_timeout=1.0))
    gate = StepGate(monkeypatch, server.worker.engine)
    if stream:
        with gate.held_from_start():
            stream = client.completions.create(model=MODEL, prompt="the cat", max_tokens=200, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True, "speculative": False})
            with pytest.raises(openai.APIError, match="--request-timeout"):  # the client raises on the error chunk
                list(stream)
        idle(server)
        with gate.held_from_start(), httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                                  timeout=30) as http:
            body = {"model": MODEL, "prompt": "the cat", "max_tokens": 200, "stream": True, "ignore_eos": True}
            events = [line for line in http.post("/v1/completions", json=body).iter_lines() if line]
        assert events[-1] == "data: [DONE]" and '"code":"request_timeout"' in events[-2]
    else:
        with gate.held_from_start(), pytest.raises(openai.APIStatusError) as info:
            complete(client, max_tokens=200, ignore_eos=True, speculative=False)
        assert info.value.status_code == 408 and error_of(info)["code"] == "request_timeout"
        assert "--request-timeout" in error_of(info)["message"]
    idle(server)
    monkeypatch.undo()
    assert complete(client, max_tokens=4).usage.completion_tokens >= 1


# -- the KV-memory guard ----------------------------------------------------------------------------------------------


def test_kv_slots_are_capped_by_free_memory(server):
    served = server.worker.served
    config = served.config
    per_slot = runtime.kv_slot_bytes(config, served.target)
    assert runtime.kv_bounded_slots(config, served.target, free_bytes=10**15) == config.max_num_seqs
    assert runtime.kv_bounded_slots(config, served.target, free_bytes=int(3.5 * per_slot / 0.9)) == 3
    with pytest.raises(ValueError, match="lower --max-len"):
        runtime.kv_bounded_slots(config, served.target, free_bytes=per_slot // 2)


# -- graceful shutdown ------------------------------------------------------------------------------------------------


class GracefulThread(ServerThread):
    """ServerThread with verispec's GracefulServer; `signal()` does what SIGTERM does in the CLI."""

    def __init__(self, app) -> None:
        super().__init__(app)
        self.server = GracefulServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5), app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def signal(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)


@pytest.mark.parametrize("shutdown_timeout", [30.0, 0.3])
def test_shutdown_drains_then_cancels(model_dirs, shutdown_timeout):
    config = ServerConfig(model=str(model_dirs["target"]), draft_model="ngram", max_len=256,
                          shutdown_timeout=shutdown_timeout)
    app = create_app(config)
    engine = app.state.server.worker.engine
    step = engine.step
    # At least 0.8 s for the stream below (a floor, whatever the machine): it outlives a 0.3 s shutdown deadline.
    engine.step = lambda: time.sleep(0.01) or step()
    running = GracefulThread(app)
    running.__enter__()
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 80, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=running.url, timeout=30) as http, httpx.Client(base_url=running.url) as other:
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            running.signal()
            refused = other.post("/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            assert other.get("/health").status_code == 503 and other.get("/metrics").status_code == 200
            events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    if shutdown_timeout > 1:  # the running stream finished normally
        assert '"finish_reason":"length"' in events[-2]
    else:  # cancelled at the deadline, with a last error chunk
        assert '"server_shutting_down"' in events[-2] and "--shutdown-timeout" in events[-2]
    running.thread.join(60)
    assert not running.thread.is_alive(), "the server did not exit"


def test_verispec_serve_exits_0_on_sigterm_after_its_stream_ends(model_dirs):
    proc = subprocess.Popen(
        [*_verispec_command(), "serve", "--model", str(model_dirs["target"]), "--draft-model", "ngram",
         "--max-len", "256", "--port", "0", "--threads", "1", "--log-level", "warning", "--api-key", KEY],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    try:
        port = None
        while port is None:
            line = lines.get(timeout=90)
            if match := re.search(r"on http://127\.0\.0\.1:(\d+)/v1; .*; API key required", line):
                port = int(match.group(1))
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"model": MODEL, "prompt": "the cat", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers=auth) as http:
            for _ in range(100):  # the line is printed just before uvicorn starts accepting
                try:
                    http.get("/health")
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines_in = r.iter_lines()
                next(line for line in lines_in if line.startswith("data: "))
                proc.send_signal(signal.SIGTERM)
                events = [line for line in lines_in if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in events[-2]
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- the command line -------------------------------------------------------------------------------------------------


def test_the_api_key_may_come_from_the_environment(monkeypatch):
    from verispec.cli import build_parser

    monkeypatch.setenv("VERISPEC_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "given"]).api_key == "given"
    monkeypatch.delenv("VERISPEC_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None


# -- SpeculativeGenerator without a tokenizer -------------------------------------------------------------------------


def test_generator_without_a_tokenizer_takes_and_returns_ids(trained_pair, tokenizer):
    from verispec import SpeculativeGenerator

    target, draft = trained_pair
    bare = SpeculativeGenerator(target, draft, tokenizer=None, K=3, max_len=128)
    full = SpeculativeGenerator(target, draft, tokenizer=tokenizer, K=3, max_len=128)
    ids = tokenizer("the cat sat")["input_ids"]
    out = bare.generate(ids, max_new_tokens=10, ignore_eos=True)
    assert out == full.generate(ids, max_new_tokens=10, ignore_eos=True) and len(out) == 10
    assert all(isinstance(t, int) for t in out)
    assert bare.generate([ids, ids[:3]], max_new_tokens=4, ignore_eos=True)[1] == full.generate(
        ids[:3], max_new_tokens=4, ignore_eos=True)
    assert list(bare.stream(ids, max_new_tokens=4)) == []  # no text without a tokenizer
    for prompt, kwargs in (("the cat", {}), ([{"role": "user", "content": "hi"}], {}), (ids, {"chat": True})):
        with pytest.raises(ValueError, match="tokenizer=None"):
            bare.generate(prompt, max_new_tokens=2, **kwargs)
    with pytest.raises(ValueError, match="stop_token_ids"):
        bare.generate(ids, max_new_tokens=2, stop=["x"])
