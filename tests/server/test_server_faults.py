"""Faults injected into a running server, with other requests in the same batch: drafters that raise, a worker
step that raises, clients that leave while queued, while being prefilled and mid-stream, and bursts past the
queue limit. Each fault ends in a clear outcome for the request it hits only; every other request gets exactly
its solo output (no token lost or duplicated); afterwards nothing is left queued or running and the next request
is answered correctly.

The server batches at most 2 sequences, lets 4 requests wait, and prefills 8 tokens per forward, so requests
queue and share steps. Driven by the official `openai` client, as in test_server_batching.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from gates import EventReader, StepGate
from test_server import MODEL, ServerThread, scrape
from test_server_batching import LONG, alone, body, idle, metrics, texts, wait_for
from verispec.config import SpeculativeConfig
from verispec.drafters import named
from verispec.drafters.ngram import NgramDrafter
from verispec.server import ServerConfig, create_app

SLOTS, QUEUE = 2, 4
CANCELLED = 'verispec_generations_total{outcome="cancelled",speculative="false"}'
GONE = 'verispec_requests_total{endpoint="/v1/completions",status="499"}'


class FaultyDrafter(NgramDrafter):
    """The n-gram drafter, except that `method` raises every time."""

    def __init__(self, method: str) -> None:
        super().__init__()
        self.method = method
        self.name = f"faulty_{method}"
        self.calls = 0

    def _fail(self) -> None:
        self.calls += 1
        raise RuntimeError(f"injected fault in {self.method}")

    def propose(self, batch):
        if self.method == "propose":
            self._fail()
        return super().propose(batch)

    def observe(self, slot, committed_length, num_accepted, num_proposed):
        if self.method == "observe":
            self._fail()


@pytest.fixture(scope="module")
def server(model_dirs):
    faulty = {f"faulty_{method}": (lambda method: lambda *_: FaultyDrafter(method))(method)
              for method in ("propose", "observe")}
    named.NAMED_DRAFTERS.update(faulty)
    config = ServerConfig(
        model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]), enable_speculative=True,
        spec=SpeculativeConfig(num_draft_tokens=3), max_len=256, max_num_seqs=SLOTS, max_batched_tokens=32,
        prefill_chunk_tokens=8, max_queued_requests=QUEUE, allowed_draft_models=("ngram", *faulty),
    )
    app = create_app(config)
    try:
        with ServerThread(app) as running:
            yield SimpleNamespace(url=running.url, app=app, worker=app.state.server.worker)
    finally:
        for name in faulty:
            del named.NAMED_DRAFTERS[name]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def scrape_now(server) -> dict:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        return scrape(http)


def clean(server) -> dict:
    """Wait until nothing is queued or running (gauges and the worker's own books), and return /metrics."""
    now = idle(server)
    worker = server.worker
    deadline = time.monotonic() + 10
    while worker._active or worker.queued:
        assert time.monotonic() < deadline, "the worker still holds a job"
        time.sleep(0.02)
    assert not worker.engine.running and not len(worker.engine.scheduler)
    return now


def serves_next(server, client) -> None:
    reference = dict(prompt="Rome is", max_tokens=12, speculative=False)
    [plain] = alone(client, [reference])
    [spec] = alone(client, [{**reference, "speculative": {"draft_tokens": 2}}])
    assert texts(plain) == texts(spec) and len(texts(plain)[0]) == 12
    clean(server)


def together(server, requests, **options):
    """All requests at once; -> each response, or the exception it raised."""
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(client.completions.create(**body(r)) for r in requests),
                                        return_exceptions=True)

    return asyncio.run(run())


# -- drafters that raise ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["propose", "observe"])
def test_a_drafter_that_raises_affects_its_own_request_only(server, client, method):
    requests = [
        dict(prompt="the cat sat on the mat. the cat", max_tokens=30, speculative={"draft_model": f"faulty_{method}"}),
        dict(prompt="one two three four", max_tokens=30, speculative={"draft_model": "ngram"}),
        dict(prompt="Paris is the", max_tokens=30),  # the served draft model
        dict(prompt="the dog sat", max_tokens=30, temperature=0.9, seed=5, speculative=False),
    ]
    # Greedy output never depends on the drafter, so the faulty request's reference is the target alone.
    solo = alone(client, [{**requests[0], "speculative": False}, *requests[1:]])
    clean(server)
    loaded = together(server, requests)
    assert [texts(r) for r in loaded] == [texts(r) for r in solo]
    assert metrics(loaded[0])["fallbacks"] >= 1  # what the client sees: its drafter failed, the target went on
    assert [metrics(r)["fallbacks"] for r in loaded[1:]] == [0, 0, 0]
    clean(server)
    serves_next(server, client)


# -- the worker raising ---------------------------------------------------------------------------------------------


def test_a_step_that_raises_fails_the_requests_in_it_and_no_other(server, client, monkeypatch):
    engine = server.worker.engine
    running = dict(prompt="the cat", max_tokens=150, n=SLOTS, speculative=False)  # fills every slot
    waiting = dict(prompt="one two three", max_tokens=20, speculative={"draft_tokens": 2})
    [reference] = alone(client, [waiting])
    clean(server)
    armed, step = threading.Event(), engine.step

    def faulty_step():
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected fault in the step")
        return step()

    monkeypatch.setattr(engine, "step", faulty_step)
    result = {}
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", "/v1/completions", json={**body(running), **body(running)["extra_body"],
                                                         "extra_body": None, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            waiter = threading.Thread(target=lambda: result.update(done=client.completions.create(**body(waiting))))
            waiter.start()
            wait_for(server, lambda m: m["verispec_queued_requests"] == 1, "the second request did not queue")
            armed.set()
            events = [line for line in lines if line.startswith("data: ")]
    waiter.join(60)
    assert events[-1] == "data: [DONE]" and '"server_error"' in events[-2] and "injected fault" in events[-2]
    assert texts(result["done"]) == texts(reference)  # the queued request never noticed
    clean(server)
    serves_next(server, client)


def test_a_job_that_fails_to_start_fails_alone(server, client, monkeypatch):
    served = server.worker.served
    encode = served.encode

    def faulty_encode(prompt, param):
        if prompt == "BOOM":
            raise RuntimeError("injected fault in encode")
        return encode(prompt, param)

    monkeypatch.setattr(served, "encode", faulty_encode)
    other = dict(prompt="the dog", max_tokens=24, speculative={"draft_tokens": 3})
    [reference] = alone(client, [other])
    failed, done = together(server, [dict(prompt="BOOM", max_tokens=4), other])
    assert isinstance(failed, openai.InternalServerError) and "injected fault" in failed.message
    assert texts(done) == texts(reference)
    clean(server)
    serves_next(server, client)


# -- clients that leave ----------------------------------------------------------------------------------------------


def stream_body(**request) -> dict:
    return {"model": MODEL, "temperature": 0, "ignore_eos": True, "stream": True, **request}


def test_a_client_that_leaves_while_queued(server, client, monkeypatch):
    other = dict(prompt="one two", max_tokens=60, speculative=False)
    [reference] = alone(client, [other])
    before = clean(server)
    gate = StepGate(monkeypatch, server.worker.engine)
    gate.hold()  # the batch stays full until the queued client has left, however fast the machine
    long = stream_body(prompt="the cat", max_tokens=120, n=SLOTS, speculative=False)
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", "/v1/completions", json=long) as r:  # taken by the idle worker
            reader = EventReader(r)
            gate.advance_until(lambda: reader.has(1))
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.url}/v1/completions", json={**stream_body(prompt=LONG, max_tokens=4),
                                                                 "stream": False}, timeout=0.3)
            wait_for(server, lambda m: m.get(GONE, 0) == before.get(GONE, 0) + 1, "the client's leaving went unseen")
            result = {}
            waiter = threading.Thread(target=lambda: result.update(done=client.completions.create(**body(other))))
            waiter.start()
            gate.release()
            events = reader.all()
    waiter.join(60)
    assert events[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(events[-3:])
    assert texts(result["done"]) == texts(reference)
    after = clean(server)
    prompt_tokens = after["verispec_prompt_tokens_total"] - before["verispec_prompt_tokens_total"]
    assert prompt_tokens < len(LONG)  # the request that left never ran
    serves_next(server, client)


def test_a_client_that_leaves_during_prefill(server, client, monkeypatch):
    other = dict(prompt="the dog sat", max_tokens=40, speculative={"draft_tokens": 2})
    [reference] = alone(client, [other])
    before = clean(server)
    gate = StepGate(monkeypatch, server.worker.engine)
    gate.hold()
    result = {}
    waiter = threading.Thread(target=lambda: result.update(done=client.completions.create(**body(other))))
    waiter.start()
    while scrape_now(server)["verispec_batch_rows"] != 1:  # step by step until the other request decodes
        gate.advance()
    long = stream_body(prompt=" ".join([LONG] * 2), max_tokens=4, speculative=False)
    # The held worker takes a new job only at the top of its loop: one step once the job is queued lets it in.
    admit = threading.Thread(target=lambda: gate.advance_once(lambda: server.worker._jobs.qsize() > 0))
    admit.start()
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", "/v1/completions", json=long) as r:
            assert r.status_code == 200
            admit.join(60)
            # Running, but not decoding: its prompt is being prefilled, 8 tokens a step (held between steps).
            for _ in range(len(long["prompt"]) // 8):
                seen = scrape_now(server)
                if (seen["verispec_running_requests"] == 2 and seen["verispec_batch_rows"] == 1
                        and seen["verispec_waiting_sequences"] == 1):
                    break
                gate.advance()
            else:
                pytest.fail(f"the prompt was not seen being prefilled: {seen}")
            assert seen["verispec_generated_tokens_total"] < before["verispec_generated_tokens_total"] + 40
    wait_for(server, lambda m: m.get(GONE, 0) == before.get(GONE, 0) + 1, "the client's leaving went unseen")
    gate.release()
    wait_for(server, lambda m: m.get(CANCELLED, 0) == before.get(CANCELLED, 0) + 1, "the prefill was not cancelled")
    waiter.join(60)
    assert texts(result["done"]) == texts(reference)
    clean(server)
    monkeypatch.undo()
    serves_next(server, client)


def test_a_client_that_leaves_mid_stream(server, client, monkeypatch):
    other = dict(prompt="Paris is the capital", max_tokens=60, speculative=False)
    [reference] = alone(client, [other])
    before = clean(server)
    result = {}
    waiter = threading.Thread(target=lambda: result.update(done=client.completions.create(**body(other))))
    waiter.start()
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", "/v1/completions", json=stream_body(prompt="the cat", max_tokens=200)) as r:
            lines = r.iter_lines()
            [line for line, _ in zip((x for x in lines if x.startswith("data: ")), range(3))]
    wait_for(server, lambda m: m.get(GONE, 0) == before.get(GONE, 0) + 1, "the client's leaving went unseen")
    waiter.join(60)
    assert texts(result["done"]) == texts(reference)
    after = clean(server)
    assert after["verispec_generated_tokens_total"] - before["verispec_generated_tokens_total"] < 60 + 200
    monkeypatch.undo()
    serves_next(server, client)


# -- more requests than the queue holds -------------------------------------------------------------------------------



def test_a_burst_past_the_queue_limit_gets_fast_429s_and_the_rest_complete(server, client, monkeypatch):
    prompts = ["the cat sat", "one two three", "Paris is the", "a bird sang"]
    requests = [dict(prompt=prompts[i % 4], max_tokens=24, speculative=False) for i in range(16)]
    solo = {p: texts(r) for p, r in zip(prompts, alone(client, requests[:4]))}
    before = clean(server)
    engine, go = server.worker.engine, threading.Event()
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: go.wait(60) and step())  # held while the test probes

    def post(http, request):
        return http.post("/v1/completions", json={**body(request), **body(request).pop("extra_body")})

    async def probe(http) -> list[float]:
        """While the queue is full: one more request at a time, as a client arriving later sees it."""
        while not server.worker.queue_full():
            await asyncio.sleep(0.005)
        latencies = []
        for _ in range(10):
            start = time.perf_counter()
            response = await post(http, requests[0])
            latencies.append(time.perf_counter() - start)
            assert response.status_code == 429 and response.headers["retry-after"] == "1", response.text
        go.set()
        return latencies

    async def burst():
        limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=len(requests) + 1)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            await asyncio.gather(*(http.get("/health") for _ in range(len(requests) + 1)))  # connections open
            return await asyncio.gather(probe(http), *(post(http, r) for r in requests))

    later, *results = asyncio.run(burst())
    refused = [r for r in results if r.status_code == 429]
    answered = [(request, r) for request, r in zip(requests, results) if r.status_code == 200]
    assert len(refused) == len(requests) - QUEUE and len(answered) == QUEUE
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in refused)
    assert all([c["text"] for c in r.json()["choices"]] == solo[request["prompt"]] for request, r in answered)
    later.sort()
    # The probes were answered while the step loop was held (`go` unset): a 429 never waits for the engine. Their
    # latencies are printed, not bounded: how fast they come is the machine's, not the server's, to say.
    print("429 latencies, s:", [round(s, 4) for s in later])
    after = clean(server)
    refusals = 'verispec_requests_total{endpoint="/v1/completions",status="429"}'
    assert after[refusals] - before.get(refusals, 0) == len(refused) + len(later)
    monkeypatch.undo()
    serves_next(server, client)
