"""`verispec serve --replicas`: two replicas of the tiny pair on a local Ray cluster (loopback), driven with the
real `openai` client. Skipped where Ray Serve is not installed (`pip install "verispec[ray]"`; `make test`
installs it; where CI is set, a skip fails).

No test assumes how fast the machine is: the fault test parks every replica's engine mid-request (the test-only
step gate, server/scale/gate.py) and kills one while it is parked, so the kill always lands mid-request; waits
are for events the tests check (with a bound), never for a guessed duration.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_server import MODEL, ServerThread
from verispec.config import SpeculativeConfig
from verispec.server import ServerConfig, create_app

try:  # each test skips without Ray Serve (and fails where CI is set: make test installs verispec[ray])
    import ray
    from ray import serve

    from verispec.server.scale import launch
    from verispec.server.scale.config import ScaleConfig
    from verispec.server.scale.ingress import APP_NAME, REPLICA_DEPLOYMENT, REPLICA_HEADER
except ImportError as missing:
    NO_RAY = f"needs Ray Serve ({missing}): pip install 'verispec[ray]'"
else:
    NO_RAY = None

KEY = "sesame"
MAX_LEN = 1024
PROMPTS = ["the cat sat", "one two three", "a bird sang in", "the dog", "four five six seven"]
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300), pytest.mark.skipif(NO_RAY is not None, reason=str(NO_RAY))]


def _free_port() -> int:
    """A free port for the ingress, outside the ranges others take between this check and Ray's bind: the kernel's
    ephemeral ports (32768-60999: a port 0 bind would come from there, and Ray's own processes take ports from
    there while the cluster starts, which once took this one first) and Ray's worker ports (10002-19999)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999")


def _config(model_dirs) -> ServerConfig:
    return ServerConfig(model=str(model_dirs["target"]), draft_model=str(model_dirs["draft"]),
                        enable_speculative=True, spec=SpeculativeConfig(num_draft_tokens=4), max_len=MAX_LEN,
                        api_key=KEY, max_num_seqs=8, max_batched_tokens=256, shutdown_timeout=5.0)


@pytest.fixture(scope="module")
def cluster(json_dirs):
    config = _config(json_dirs)
    port = _free_port()
    # imbalance 1: concurrent requests spread over both replicas (sequential ones still follow their prefix)
    scale = ScaleConfig(replicas=2, threads=1, object_store_gb=0.1, step_gate=True, imbalance=1)
    launch.start(config, scale, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        launch.drain_and_stop(config)


@pytest.fixture(scope="module")
def single(json_dirs, one_torch_thread):
    with ServerThread(create_app(_config(json_dirs))) as running:
        yield running.url


@pytest.fixture(scope="module")
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def _complete(client, prompt, max_tokens=24, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body=extra or None)


def _stats(url: str) -> dict:
    r = httpx.get(f"{url}/v1/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _until(condition, what: str, bound_s: float = 120.0):
    """Wait for an event (polling), failing after a generous bound: never a guess at a duration."""
    deadline = time.monotonic() + bound_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)
    return value


def test_outputs_equal_the_single_server(cluster, single):
    replicated, alone = _client(cluster), _client(single)
    for prompt in PROMPTS:
        a, b = _complete(replicated, prompt), _complete(alone, prompt)
        assert a.choices[0].text == b.choices[0].text and a.usage == b.usage
    messages = [{"role": "user", "content": "the cat"}]
    a = replicated.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    b = alone.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_streaming_matches_the_whole_answer(cluster):
    client = _client(cluster)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "one two"}],
                                           max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "one two"}],
                                                 max_tokens=20, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) > 3 and text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_api_key_and_limits_are_enforced(cluster):
    with pytest.raises(openai.AuthenticationError):
        _complete(_client(cluster, key="wrong"), "the cat")
    r = httpx.post(f"{cluster}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": "x" * (5 * 2**20)}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError):  # the replica's own validation, through the ingress
        _complete(_client(cluster), "the cat", max_tokens=10, min_tokens=20)
    assert httpx.get(f"{cluster}/metrics").status_code == 200  # open without the key, as in one process


def test_shared_prefix_goes_to_one_replica(cluster):
    client = _client(cluster).with_raw_response
    prefix = "the cat sat on the mat. the dog sat on the log. " * 12  # longer than the routing key
    replicas = {client.completions.create(model=MODEL, prompt=prefix + tail, max_tokens=4,
                                          temperature=0).headers[REPLICA_HEADER] for tail in ("a", "b", "c", "d")}
    assert len(replicas) == 1
    seen = {client.completions.create(model=MODEL, prompt=f"{i} " + prefix, max_tokens=2,
                                      temperature=0).headers[REPLICA_HEADER] for i in range(12)}
    assert len(seen) == 2  # different starts spread over both replicas


def _replica_sums(text: str) -> tuple[dict, dict]:
    """/metrics -> ({series: total}, {series: sum over replica-labelled series})."""
    total, by_replica = {}, {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "replica"}
            key = (s.name, tuple(sorted(labels.items())))
            if "replica" in s.labels:
                by_replica[key] = by_replica.get(key, 0.0) + s.value
            else:
                total[key] = s.value
    return total, by_replica


def test_metrics_sum_the_replicas(cluster):
    before = _stats(cluster)["totals"].get("verispec_generated_tokens_total", 0.0)
    client = _client(cluster)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: _complete(client, p, max_tokens=12), PROMPTS * 2))
    stats = _stats(cluster)
    assert len(stats["replicas"]["live"]) == 2 and len(stats["by_replica"]) >= 2
    generated = sum(a.usage.completion_tokens for a in answers)
    assert stats["totals"]["verispec_generated_tokens_total"] - before == generated
    total, by_replica = _replica_sums(httpx.get(f"{cluster}/metrics").text)
    counters = [k for k in total if k[0].endswith(("_total", "_bucket", "_count", "_sum")) and k in by_replica]
    assert len(counters) > 20 and ("verispec_generated_tokens_total", ()) in counters
    for key in counters:
        assert total[key] == pytest.approx(by_replica[key]), key
    assert stats["summary"]["mean_accepted_length"] >= 1.0


def _hold(replica: str, park: bool, min_tokens: int = 0) -> int:
    """Arm (park=True) or open a replica's step gate. -> its decoding sequences while parked now (0: not parked)."""
    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, APP_NAME)
    return handle.hold.remote(park, replica=replica, min_tokens=min_tokens).result(timeout_s=60)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["city", "count"]}
# Eight streams, each a kind the failover must carry across exactly: (endpoint, body fields).
KILL_CASES = [
    ("/v1/completions", {"prompt": "the cat sat", "temperature": 0, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "one two three"}], "temperature": 0}),
    ("/v1/completions", {"prompt": "a bird sang in", "temperature": 1.0, "seed": 11, "ignore_eos": True,
                         "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the dog"}], "temperature": 0.8,
                              "seed": 5, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": "four five six", "temperature": 0, "logprobs": 3, "ignore_eos": True,
                         "logit_bias": {"10": 2.0}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Paris is"}], "temperature": 0,
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "place", "schema": SCHEMA}}}),
    ("/v1/completions", {"prompt": "the cat sat on the", "temperature": 0, "stop": ["the log", "."],
                         "min_tokens": 6, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "one two", "temperature": 0.9, "seed": 3, "ignore_eos": True}),
]
KILL_TOKENS = 48


def _stream(url: str, path: str, fields: dict, replicas: dict | None = None, index: int = 0, seen=None) -> dict:
    """One streamed request read raw -> {"events": parsed data events, "error": an error event or None, "done":
    [DONE] came, "leaked": a comment line reached the client}. `replicas[index]`: the replica that started it;
    `seen[index]`: events read so far (for the caller to wait on)."""
    body = {"model": MODEL, "max_tokens": KILL_TOKENS, "stream": True, "stream_options": {"include_usage": True},
            **fields}
    out = {"events": [], "error": None, "done": False, "leaked": False}
    with httpx.stream("POST", f"{url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=240) as r:
        assert r.status_code == 200, r.read()
        if replicas is not None:
            replicas[index] = r.headers[REPLICA_HEADER]
        for line in r.iter_lines():
            if line.startswith(":"):
                out["leaked"] = True
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
            else:
                out["events"].append(event)
                if seen is not None:
                    seen[index] = seen.get(index, 0) + 1
    return out


def _answer(stream: dict) -> dict:
    """What a client makes of a stream: its text, logprobs, finish reason, usage, and its one id."""
    text, logprobs, finish, usage, ids = [], [], None, None, set()
    for event in stream["events"]:
        ids.add(event["id"])
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            delta = choice.get("delta")
            text.append(choice.get("text") or (delta or {}).get("content") or "")
            lp = choice.get("logprobs")
            if lp:
                logprobs += lp["content"] if "content" in lp else list(zip(lp["tokens"], lp["token_logprobs"],
                                                                          lp["top_logprobs"], lp["text_offset"]))
            finish = choice.get("finish_reason") or finish
    return {"text": "".join(text), "logprobs": logprobs, "finish": finish,
            "completion_tokens": None if usage is None else usage["completion_tokens"], "ids": len(ids),
            "error": stream["error"], "done": stream["done"], "leaked": stream["leaked"]}


@pytest.fixture(scope="module")
def no_kill(cluster) -> list[dict]:
    """The KILL_CASES streams' answers without a kill."""
    return [_answer(_stream(cluster, path, fields)) for path, fields in KILL_CASES]


def _kill_mid_stream(url: str) -> tuple[list[dict], int, str]:
    """The eight KILL_CASES streams with every replica parked once each of its streams has sent tokens, one replica
    killed there and the other let go. -> (the answers, streams the dead replica had started, its id)."""
    replicas = _stats(url)["replicas"]["live"]
    for replica in replicas:
        _hold(replica, True, min_tokens=2)
    survivors = list(replicas)
    started, seen = {}, {}
    try:
        with ThreadPoolExecutor(len(KILL_CASES)) as pool:
            futures = [pool.submit(_stream, url, path, fields, started, i, seen)
                       for i, (path, fields) in enumerate(KILL_CASES)]
            # Parked with every stream there decoding: none can finish before the kill, however fast the machine.
            victim, rows = _until(lambda: next(((r, n) for r in replicas if (n := _hold(r, True, 2))), None),
                                  "a replica parked mid-stream")
            # Its streams' tokens so far have reached their clients: the kill lands mid-stream for each of them.
            _until(lambda: sum(1 for i, r in started.items() if r == victim and seen.get(i)) >= rows,
                   "the parked replica's streams under way at their clients")
            cut = sum(1 for r in started.values() if r == victim)
            ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{REPLICA_DEPLOYMENT}#{victim}", namespace="serve"),
                     no_restart=True)
            survivors.remove(victim)
            for replica in survivors:
                _hold(replica, False)
            answers = [_answer(f.result(timeout=240)) for f in futures]
    finally:
        for replica in survivors:
            _hold(replica, False)
    _until(lambda: len(_stats(url)["replicas"]["live"]) == 2, "the killed replica replaced")
    return answers, cut, victim


def test_a_replica_killed_mid_stream_is_not_noticed(cluster, no_kill):
    """Every stream running on a replica killed mid-stream goes on in the other replica (server/scale/ingress.py,
    Failover): it completes with exactly the answer it gets without the kill (greedy, seeded sampling with
    penalties, logprobs bit for bit, logit_bias, a JSON schema, stop strings with min_tokens), one id, the same
    finish reason and usage, and no progress report reaches the client."""
    stats = _stats(cluster)
    before = stats["ingress"]
    expected = no_kill
    answers, cut, victim = _kill_mid_stream(cluster)
    assert cut >= 1
    print(f"streams on the killed replica: {cut} of {len(answers)}")
    for i, (want, got) in enumerate(zip(expected, answers)):
        assert want["error"] is None and want["done"] and want["ids"] == 1 and not want["leaked"], (i, want)
        assert got == want, (i, KILL_CASES[i], got, want)
    assert expected[5]["text"].startswith('{"city":')  # the schema's output (cut by max_tokens)
    after = _stats(cluster)
    own = after["ingress"]
    resumed = own.get("verispec_resumed_streams_total", 0) - before.get("verispec_resumed_streams_total", 0)
    assert resumed == cut, (resumed, cut)
    assert own.get("verispec_cut_streams_total", 0) == before.get("verispec_cut_streams_total", 0)
    assert victim in after["replicas"]["retired"]  # replaced; its counters stay
    for series, value in stats["totals"].items():
        if series.endswith("_total"):
            assert after["totals"].get(series, 0.0) >= value, series
    assert _complete(_client(cluster), "the cat").choices[0].text  # and it serves again


@pytest.mark.slow  # .ci/run runs it (make test's 5 minutes)
def test_without_failover_the_kill_is_seen(cluster, no_kill):
    """The negative control: with failover off (--no-failover), the same kill ends the dead replica's streams with
    the retryable error event, so the test above can fail."""
    app = serve.get_app_handle(APP_NAME)
    app.set_failover.remote(False).result(timeout_s=60)
    try:
        answers, cut, _ = _kill_mid_stream(cluster)
    finally:
        app.set_failover.remote(True).result(timeout_s=60)
    broken = [i for i, (want, got) in enumerate(zip(no_kill, answers)) if got != want]
    assert len(broken) == cut >= 1, (broken, cut)
    for i in broken:
        assert answers[i]["error"]["code"] == "replica_unavailable" and answers[i]["done"]
        assert no_kill[i]["text"].startswith(answers[i]["text"])


def test_health_counts_ready_replicas(cluster):
    r = httpx.get(f"{cluster}/health", timeout=60)
    assert r.status_code == 200 and r.json()["replicas"]["ready"] == 2, r.text


def _ready(url: str) -> int:
    r = httpx.get(f"{url}/health", timeout=60)
    return r.json()["replicas"]["ready"]


@pytest.mark.slow  # .ci/run runs it (make test's 5 minutes)
def test_chaos_replicas_killed_under_load(cluster, no_kill):
    """Bounded chaos: clients keep sending streams and whole answers (KILL_CASES, and greedy JSON completions) while
    a replica is killed, its replacement awaited, and the other killed, and the load goes on: no client sees an
    error and every answer equals its answer without kills. Not timed against the engine: the kills land wherever the load is (the
    mid-stream case is the step-gated test above); the count of resumed streams is printed."""
    expected = no_kill
    client = _client(cluster)
    whole = {p: _complete(client, p, max_tokens=24).choices[0].text for p in PROMPTS}
    before = _stats(cluster)["ingress"]
    stop, failures, done, served_by = threading.Event(), [], [], {}

    def load(worker: int) -> None:
        i = worker
        while not stop.is_set():
            try:
                if i % 3 == 2:
                    prompt = PROMPTS[i % len(PROMPTS)]
                    text = _complete(client, prompt, max_tokens=24).choices[0].text
                    if text != whole[prompt]:
                        failures.append(("json", prompt, text))
                else:
                    case = i % len(KILL_CASES)
                    got = _answer(_stream(cluster, *KILL_CASES[case], served_by, i))
                    if got != expected[case]:
                        failures.append(("stream", case, got))
            except Exception as exc:  # noqa: BLE001 - any error a client sees is a failure
                failures.append(("error", repr(exc)))
            done.append(i)
            i += 6

    workers = [threading.Thread(target=load, args=(w,)) for w in range(6)]
    for w in workers:
        w.start()
    try:
        for _ in range(2):
            _until(lambda: _ready(cluster) == 2, "both replicas ready")
            served_by.clear()
            # A replica that started a stream after both were ready is alive (its actor name may outlive it).
            victim = random.choice(list(_until(lambda: dict(served_by), "load under way").values()))
            ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{REPLICA_DEPLOYMENT}#{victim}", namespace="serve"),
                     no_restart=True)
        _until(lambda: _ready(cluster) >= 1, "a replica ready")
        count = len(done)
        _until(lambda: len(done) > count + 2, "load served after the kills")
    finally:
        stop.set()
        for w in workers:
            w.join(240)
    own = _stats(cluster)["ingress"]
    resumed = own.get("verispec_resumed_streams_total", 0) - before.get("verispec_resumed_streams_total", 0)
    print(f"chaos: {len(done)} requests, 2 kills, {resumed} streams resumed, {len(failures)} failures")
    assert not failures, failures[:3]
    assert len(done) >= 12


class _FakeStream:
    """A replica's streamed answer as the ingress sees it: the head, then one SSE chunk; each item after a yield to
    the event loop, as a Ray object ref arrives."""

    def __init__(self) -> None:
        self.items = [{"status": 200, "headers": [("content-type", "text/event-stream")], "replica": "fake"},
                      b"data: {}\n\n"]
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class _FakeReplicas:
    """The Replica deployment's handle, as much as `Ingress.forward` uses of it."""

    def __init__(self) -> None:
        self.streams: list[_FakeStream] = []
        self.calls = []
        self.http = self

    def options(self, **_):
        return self

    def remote(self, call, key=None, avoid=()):
        self.calls.append(call)
        self.streams.append(_FakeStream())
        return self.streams[-1]


@pytest.mark.parametrize("leaves", ["before_the_stream", "after_it_ended"])
def test_a_client_gone_before_its_stream_starts_frees_its_place(model_dirs, leaves):
    """The ingress's count of generations in flight (its 429 bound) comes back to 0 however a stream ends, also
    when the client left before the first chunk (the body's generator then never starts), and a stream not read
    to its end is cancelled at the replica. The ASGI app is driven by hand, no Ray: every step is the test's. The
    failover's private headers are the ingress's own: a client's are dropped, and the stream asks for progress."""
    from verispec.server.scale.ingress import Ingress, build_app

    replicas = _FakeReplicas()
    config = _config(model_dirs)
    ingress = Ingress(replicas, replace(config, api_key=None), ScaleConfig(replicas=1))
    app = build_app(ingress)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()
    sent = []

    async def receive():
        if not sent and not getattr(receive, "read", False):
            receive.read = True
            return {"type": "http.request", "body": body, "more_body": False}
        if leaves == "after_it_ended":
            await asyncio.Event().wait()  # never leaves: the stream runs to its end
        return {"type": "http.disconnect"}

    async def send(message):
        await asyncio.sleep(0)  # a real send suspends: the disconnect is seen first
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                               (b"x-verispec-resume", b'{"tokens": [1]}')],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 60))
    assert len(replicas.streams) == 1 and ingress.generations == 0
    assert dict(replicas.calls[0].headers) == {b"content-type": b"application/json", b"x-verispec-progress": b"1"}
    bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if leaves == "after_it_ended":
        assert bodies == b"data: {}\n\n" and not replicas.streams[0].cancelled
    else:
        assert bodies == b"" and replicas.streams[0].cancelled


@pytest.mark.parametrize("argv", [["--replicas", "2", "--min-replicas", "3"], ["--replicas", "1", "--port", "70000"],
                                  ["--replicas", "2", "--draft-device", "meta"]])
def test_serve_rejects_bad_replica_flags(argv, model_dirs, capsys):
    from verispec.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--model", str(model_dirs["target"]), *argv])
    assert info.value.code == 2 and "error:" in capsys.readouterr().err


def test_drain_lets_running_streams_finish_and_refuses_new_requests(cluster):
    """Last in this file: the ingress stays draining (as on SIGTERM, before Serve stops)."""
    from threading import Event, Thread

    client = _client(cluster)
    started, outcome = Event(), {}

    def stream() -> None:
        chunks = client.completions.create(model=MODEL, prompt="the cat", max_tokens=400, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        text = []
        for chunk in chunks:
            started.set()
            text.append(chunk.choices[0].text if chunk.choices else "")
            outcome["finish"] = chunk.choices[0].finish_reason if chunk.choices else outcome.get("finish")
        outcome["chars"] = len("".join(text))

    reader = Thread(target=stream)
    reader.start()
    assert started.wait(120)
    draining = serve.get_app_handle(APP_NAME).drain.remote(120)

    def refused() -> bool:
        try:
            _complete(client, "one", max_tokens=1)
            return False
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.body["code"] == "server_shutting_down"
            return True

    _until(refused, "a 503 while draining")
    reader.join(240)
    assert outcome.get("finish") == "length" and outcome["chars"] > 0
    assert draining.result(timeout_s=120) == 0
