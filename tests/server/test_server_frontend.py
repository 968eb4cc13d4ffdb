"""The server's front end prepares requests off the engine thread (server/prepare.py): while a large JSON schema
compiles, every other stream keeps getting its chunk at every step, and a request whose client leaves while it
is being prepared never reaches the engine.

The compilation is held by the test (the grammar's compile function waits on an event), never guessed from the
clock: the schema is large (its real compile time is measured and printed), but what the test shows holds
however fast the machine compiles it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import OrderedDict
from types import SimpleNamespace

import httpx
import pytest

from conftest import JSON_CHARS, make_tokenizer, tiny_llama
from gates import WAIT_S, EventReader, StepGate
from test_server import ServerThread
from test_server_batching import wait_for
from verispec.config import SamplingParams, StructuredOutput
from verispec.sampling import grammar
from verispec.server import ServerConfig, create_app

MODEL = "target"
GONE = 'verispec_requests_total{endpoint="/v1/completions",status="499"}'


def large_schema(values: int) -> dict:
    """An object with one string from `values` choices: large to compile (a trie of every value), short to write."""
    return {"type": "object", "properties": {"pick": {"enum": [f"item {i:05d} of the list" for i in range(values)]}},
            "required": ["pick"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A target whose vocabulary spells JSON (untrained: only its determinism matters), no drafter."""
    tokenizer = make_tokenizer(JSON_CHARS)
    path = tmp_path_factory.mktemp("frontend") / "target"
    tiny_llama(30, vocab=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    config = ServerConfig(model=str(path), max_len=256, max_num_seqs=4, max_batched_tokens=64, prefill_chunk_tokens=16)
    app = create_app(config)
    with ServerThread(app) as running:
        yield SimpleNamespace(url=running.url, app=app, worker=app.state.server.worker)


class HeldCompile:
    """Wraps the grammar's compile step (`grammar_source`, called only when a grammar is not cached) for one schema:
    its compilation waits until `release()`. The engine thread is never held: were the compile there, the test
    would fail on what the engine holds (and `threads`) instead of hanging the step loop."""

    def __init__(self, monkeypatch, spec: str) -> None:
        self.started, self._go = threading.Event(), threading.Event()
        self.threads: list[str] = []
        source = grammar.grammar_source

        def held(structured):
            if structured.spec == spec:
                self.threads.append(threading.current_thread().name)
                self.started.set()
                if threading.current_thread().name != "verispec-engine":
                    assert self._go.wait(WAIT_S), "the test never released the compilation"
            return source(structured)

        monkeypatch.setattr(grammar, "grammar_source", held)
        monkeypatch.setattr(grammar, "_MATCHERS", OrderedDict())  # compiled in this test, not found in the cache

    def release(self) -> None:
        self._go.set()


def schema_request(spec: dict, **extra) -> dict:
    return {"model": MODEL, "prompt": "the list: ", "max_tokens": 64, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": spec}}, **extra}


def test_a_large_schema_compiling_holds_up_no_stream(server, monkeypatch):
    worker, engine = server.worker, server.worker.engine
    spec = large_schema(20_000)
    text = json.dumps(spec)
    started = time.perf_counter()
    engine.new_grammar(SamplingParams(structured=StructuredOutput("json_schema", text)))
    compile_s = time.perf_counter() - started
    held = HeldCompile(monkeypatch, text)
    plain = {"model": MODEL, "prompt": "the cat", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
             "stream": True, "logprobs": 1}  # logprobs: every round posts a chunk, whatever text it decodes to
    gate = StepGate(monkeypatch, engine)
    gate.hold()
    result = {}
    step_s = []
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", "/v1/completions", json=plain) as r:  # taken by the idle worker
            events = EventReader(r)
            gate.advance_until(lambda: events.has(1))  # the plain request decodes
            waiter = threading.Thread(target=lambda: result.update(
                done=httpx.post(f"{server.url}/v1/completions", json=schema_request(spec), timeout=WAIT_S)))
            waiter.start()
            # Steps go on until its compilation starts (none needed here: the front end takes it at once; an engine
            # thread that prepared jobs itself would take it only between two steps).
            gate.advance_until(lambda: held.started.wait(0.05))
            for _ in range(5):  # while it compiles, every step is a step of the stream: a chunk each
                seen = len(events.events)
                t0 = time.perf_counter()
                gate.advance()
                step_s.append(time.perf_counter() - t0)
                assert events.has(seen + 1, wait_s=WAIT_S), "a step passed without the stream's chunk"
            assert len(engine.running) == 1 and not len(engine.scheduler)  # the schema request is not in yet
            assert worker.queued == 1  # but it counts against the queue limit
            held.release()
            # Once prepared, the held worker takes it at the top of its loop: one step lets it in, and that step
            # and the next are still steps of the stream.
            seen = len(events.events)
            gate.advance_once(lambda: worker._jobs.qsize() > 0)
            gate.advance()
            assert events.has(seen + 2, wait_s=WAIT_S)
            assert len(engine.running) + len(engine.scheduler) == 2
            gate.release()
            waiter.join(WAIT_S)
            events.all()
    print(f"the schema compiles in {compile_s * 1e3:.0f} ms here; a held step of the stream took "
          f"{min(step_s) * 1e3:.1f}-{max(step_s) * 1e3:.1f} ms (gate round trip included)")
    assert held.threads and all(name.startswith("verispec-prepare") for name in held.threads), held.threads
    response = result["done"]
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["text"])["pick"] in spec["properties"]["pick"]["enum"]
    alone = httpx.post(f"{server.url}/v1/completions", json=schema_request(spec), timeout=WAIT_S)  # compiled now
    assert alone.json()["choices"][0]["text"] == choice["text"]


def test_a_request_whose_client_leaves_while_it_is_prepared_never_reaches_the_engine(server, monkeypatch):
    worker, engine = server.worker, server.worker.engine
    spec = large_schema(5_000)
    held = HeldCompile(monkeypatch, json.dumps(spec))
    added = []
    add_request = engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda *a, **k: added.append(a) or add_request(*a, **k))
    before = wait_for(server, lambda m: m["verispec_queued_requests"] == 0, "a request is still queued")
    body = json.dumps(schema_request(spec, stream=True)).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert held.started.wait(WAIT_S), "the schema never started compiling"
    # The client is gone while its grammar compiles; the handler sees it and cancels the job.
    wait_for(server, lambda m: m.get(GONE, 0) == before.get(GONE, 0) + 1, "the client's leaving went unseen")
    held.release()
    after = wait_for(server, lambda m: m["verispec_queued_requests"] == 0, "the dropped job still counts as queued")
    assert worker.queued == 0 and not worker._active and not worker._jobs.qsize()
    assert added == []  # it never reached the engine
    assert after["verispec_prompt_tokens_total"] == before["verispec_prompt_tokens_total"]
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "the cat", "max_tokens": 4},
                    timeout=WAIT_S)
    assert ok.status_code == 200 and len(added) == 1


def test_requests_prepared_together_get_what_they_get_alone(server):
    """Several requests prepared at once (two front-end threads, one grammar cache) answer as each does alone."""
    constraints = [{"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}",
                                                                               "schema": large_schema(50 + i)}}}
                   for i in range(3)]
    constraints += [{"guided_regex": "(the|a) (cat|dog) sat"}, {"guided_choice": ["Paris", "Rome"]},
                    {"response_format": {"type": "json_object"}}, {}]
    requests = [{"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "n": 2, **constraint}
                for prompt in ("the list: ", "Paris is") for constraint in constraints]

    def post_all(http):
        return asyncio.gather(*(http.post("/v1/completions", json=request) for request in requests))

    async def together():
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as http:
            return await post_all(http)

    with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
        alone = [http.post("/v1/completions", json=request) for request in requests]
    grammar._MATCHERS.clear()  # compiled again, on both threads at once
    loaded = asyncio.run(together())
    assert all(r.status_code == 200 for r in alone + loaded)
    assert [r.json()["choices"] for r in loaded] == [r.json()["choices"] for r in alone]
