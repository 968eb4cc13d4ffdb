"""Continuous batching in the server, end to end: a real uvicorn server on 127.0.0.1, driven by the official
`openai` client (async for concurrent requests).

The server batches at most 4 sequences and feeds at most 32 tokens per step in 8-token prefill chunks, so these
requests queue, prefill in chunks and share steps. What a request gets must not depend on that: greedy text and
the speculative metrics of a fixed K equal the request's alone, seeded samples too; a client that leaves frees its
row before the next step; every gauge returns to zero.
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
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app
from verispec.server.worker import JobHandle

LONG = "the cat sat on the mat. the dog sat on the log. a bird sang in the tree. one two three four"
GAUGES = ("verispec_queued_requests", "verispec_running_requests", "verispec_batch_rows",
          "verispec_waiting_sequences")

GREEDY = [
    dict(prompt="the cat sat", max_tokens=30),  # the server's default: adaptive K
    dict(prompt="one two three", max_tokens=24, speculative=False),
    dict(prompt="Paris is the capital of France. Rome is", max_tokens=20, speculative={"draft_tokens": 2}),
    dict(prompt="the dog", max_tokens=28, speculative={"draft_tokens": 5}),
    dict(prompt="a bird sang in the tree. a bird", max_tokens=16, speculative={"draft_model": "ngram"}),
    dict(prompt="seven eight", max_tokens=22, n=2, speculative={"draft_tokens": 3}),
    dict(prompt=LONG, max_tokens=12, speculative={"draft_tokens": 3}),  # prefilled in several chunks
    dict(prompt="the cat sat on the mat.", max_tokens=26, speculative=False),
]
SEEDED = [
    dict(prompt="a bird", max_tokens=20, temperature=1.0, seed=7,  # seeded rejection sampling: a fixed K
         speculative={"coupling": "rejection"}),
    dict(prompt="the cat", max_tokens=20, temperature=0.8, seed=3, top_k=8, speculative=False),
    dict(prompt="one two", max_tokens=16, temperature=1.2, seed=11, n=2, speculative={"draft_tokens": 4}),
]
FIXED_K_METRICS = ("rounds", "draft_tokens", "accepted_tokens", "acceptance_by_position")


@pytest.fixture(scope="module")
def server(model_dirs):
    config = ServerConfig(
        model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]), enable_speculative=True,
        spec=SpeculativeConfig(num_draft_tokens=3, adaptive=True, max_speculation_depth=6), max_len=256,
        max_num_seqs=4, max_batched_tokens=32, prefill_chunk_tokens=8,
    )
    app = create_app(config)
    with ServerThread(app) as running:
        yield SimpleNamespace(url=running.url, app=app, worker=app.state.server.worker)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def body(request: dict) -> dict:
    """A request's keyword arguments for `completions.create` (verispec's fields in extra_body)."""
    request = dict(request)
    extra = {"ignore_eos": True}
    for name in ("speculative", "top_k"):
        if name in request:
            extra[name] = request.pop(name)
    return {"model": MODEL, "temperature": 0, **request, "extra_body": extra}


def alone(client, requests):
    return [client.completions.create(**body(r)) for r in requests]


def together(server, requests):
    """All requests at once from one async client; -> responses in order."""
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(client.completions.create(**body(r)) for r in requests))

    return asyncio.run(run())


def texts(response) -> list[str]:
    return [choice.text for choice in response.choices]


def metrics(response) -> dict:
    return response.model_extra["speculative_metrics"]


def wait_for(server, condition, what: str, seconds: float = 20) -> dict:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        deadline = time.monotonic() + seconds
        while not condition(now := scrape(http)):
            assert time.monotonic() < deadline, what
            time.sleep(0.05)
    return now


def idle(server) -> dict:
    return wait_for(server, lambda m: all(m[g] == 0 for g in GAUGES), "a gauge did not return to zero")


def test_concurrent_greedy_requests_return_what_they_return_alone(server, client):
    solo = alone(client, GREEDY)
    before = idle(server)
    loaded = together(server, GREEDY)
    after = idle(server)
    assert [texts(r) for r in loaded] == [texts(r) for r in solo]
    assert [len(r.choices[0].text) for r in loaded] == [r["max_tokens"] for r in GREEDY]  # one char per token
    for request, mine, reference in zip(GREEDY, loaded, solo):
        option = request.get("speculative")
        if option is False or (isinstance(option, dict) and "draft_tokens" in option):  # off, or a fixed K
            assert {k: metrics(mine)[k] for k in FIXED_K_METRICS} == {k: metrics(reference)[k] for k in
                                                                      FIXED_K_METRICS}
    assert metrics(loaded[1])["draft_tokens"] == 0 and metrics(loaded[1])["rounds"] == 24

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    # They did share steps (several rows per step), and some waited: 9 choices, 4 slots.
    assert moved('verispec_step_rows_bucket{le="1.0"}') < moved("verispec_step_rows_count")
    assert moved('verispec_step_rows_bucket{le="4.0"}') == moved("verispec_step_rows_count")
    # The chosen-K distribution counts one K per round of every speculating row.
    chosen = {k: moved(f'verispec_chosen_k_total{{k="{k}"}}') for k in range(7)}
    assert sum(chosen.values()) == sum(metrics(r)["rounds"] for r in loaded if metrics(r)["enabled"])
    assert chosen[2] >= metrics(loaded[2])["rounds"] - 1  # its K, but the last round may be cut to what is left
    assert moved("verispec_generated_tokens_total") == sum(r.usage.completion_tokens for r in loaded)
    assert moved('verispec_generations_total{outcome="ok",speculative="true"}') == 7


def test_seeded_sampling_is_reproducible_alone_and_under_load(server, client):
    solo = alone(client, SEEDED)
    assert [texts(r) for r in alone(client, SEEDED)] == [texts(r) for r in solo]
    loaded = together(server, [*GREEDY[:3], *SEEDED, GREEDY[6]])[3:6]
    assert [texts(r) for r in loaded] == [texts(r) for r in solo]
    assert texts(solo[2])[0] != texts(solo[2])[1]  # n = 2: seeds 11 and 12
    idle(server)


def test_a_client_that_disconnects_mid_stream_frees_its_row_at_the_next_step(server, client, monkeypatch):
    engine = server.worker.engine
    steps, cancels, aborts = [], [], []
    step, abort, cancel = engine.step, engine.abort, JobHandle.cancel

    def counting_step():
        steps.append(len(engine.running))
        return step()

    def counting_abort(seq):
        aborts.append((len(steps), seq))
        abort(seq)

    def counting_cancel(handle):
        cancels.append((len(steps), handle))
        cancel(handle)

    monkeypatch.setattr(engine, "step", counting_step)
    monkeypatch.setattr(engine, "abort", counting_abort)
    monkeypatch.setattr(JobHandle, "cancel", counting_cancel)
    other = dict(prompt="one two three", max_tokens=200, speculative=False)
    reference = alone(client, [other])[0]
    idle(server)
    steps.clear(), cancels.clear(), aborts.clear()

    result = {}
    runner = threading.Thread(target=lambda: result.update(done=client.completions.create(**body(other))))
    stream = {"model": MODEL, "prompt": "the cat", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
              "stream": True, "speculative": False}
    gate = StepGate(monkeypatch, engine)  # outside the counting step: a held step is not counted yet
    gate.hold()  # step by step: the other request cannot finish before the client has left
    runner.start()
    gate.wait_parked()  # the other request was taken by the idle worker
    # The held worker takes a new job only at the top of its loop: one step once the job is queued lets it in.
    admit = threading.Thread(target=lambda: gate.advance_once(lambda: server.worker._jobs.qsize() > 0))
    admit.start()
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", "/v1/completions", json=stream) as r:
            admit.join(60)
            events = EventReader(r)
            gate.advance_until(lambda: events.has(3))
            left_at = len(steps)

    def seen_leaving() -> bool:  # noticed when one of its events cannot be sent: step by step until then
        deadline = time.monotonic() + 0.05
        while not any(at >= left_at for at, _ in cancels) and time.monotonic() < deadline:
            time.sleep(0.005)
        return any(at >= left_at for at, _ in cancels)

    gate.advance_until(seen_leaving, limit=50)
    assert "done" not in result  # the other request is still decoding
    gate.release()
    wait_for(server, lambda m: m["verispec_batch_rows"] <= 1, "the row of the client that left is still there")
    runner.join(60)
    assert texts(result["done"]) == texts(reference)  # and it was not disturbed
    [(aborted_at, seq)] = aborts
    assert seq.finish_reason is None and len(seq.stopper.token_ids) < 200
    first_cancel = min(at for at, _ in cancels if at >= left_at)
    # Cancelled during step s (or just after it): its row is gone before step s + 1, or s + 2 at the latest.
    assert aborted_at - first_cancel <= 1
    assert all(rows <= 1 for rows in steps[aborted_at:])
    after = idle(server)
    assert after['verispec_generations_total{outcome="cancelled",speculative="false"}'] >= 1


def test_a_queued_request_whose_client_left_never_runs(server, monkeypatch):
    """While one request fills every slot, a second one waits; its client gives up; it is dropped unrun."""
    long = {"model": MODEL, "prompt": "the cat", "max_tokens": 200, "n": 4, "ignore_eos": True,
            "temperature": 0, "stream": True, "speculative": False}
    # Had it run, the prompt-token counter would show its prompt, longer than all of the long request's.
    queued = {**long, "stream": False, "n": 1, "max_tokens": 4, "prompt": "the dog sat on the log. " * 8}
    gone = 'verispec_requests_total{endpoint="/v1/completions",status="499"}'
    cancelled = 'verispec_generations_total{outcome="cancelled",speculative="false"}'
    before = idle(server)
    gate = StepGate(monkeypatch, server.worker.engine)
    gate.hold()  # the long request can neither finish nor make room while the queued client waits and leaves
    with httpx.Client(base_url=server.url, timeout=60) as own:
        with own.stream("POST", "/v1/completions", json=long) as r:  # taken by the idle worker
            events = EventReader(r)
            gate.advance_until(lambda: events.has(1))  # the long request runs
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.url}/v1/completions", json=queued, timeout=0.3)
            during = wait_for(server, lambda m: m.get(gone, 0) == before.get(gone, 0) + 1,
                              "the client's leaving went unseen")
            assert during.get(cancelled, 0) == before.get(cancelled, 0)  # the long request still runs
            assert during["verispec_batch_rows"] == 4
    # The stream's leaving is seen when its next event cannot be sent: after a step, long before its 200 tokens.
    gate.release()
    # the stream's 499 is counted by its handler, which may still be unwinding when the gauges reach zero: waited for
    after = wait_for(server, lambda m: all(m[g] == 0 for g in GAUGES) and m.get(gone, 0) >= before.get(gone, 0) + 2,
                     "the stream's leaving went unseen")
    assert after[gone] == before.get(gone, 0) + 2
    assert after[cancelled] == before.get(cancelled, 0) + 4  # the long request's four choices, not the queued one
    prompt_tokens = after["verispec_prompt_tokens_total"] - before["verispec_prompt_tokens_total"]
    assert prompt_tokens < len(queued["prompt"])  # the queued request never ran
