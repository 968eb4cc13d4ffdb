"""`Ingress`: the one HTTP entry of the replicas, Ray Serve's FastAPI ingress.

- The single server's guard runs here first (server/guard.py: API key, body limit, drain's 503s, a 429 once
  `replicas x max_num_seqs + max_queued_requests` generations are in flight), then again inside the replica.
- Every other route is forwarded whole to a replica (`Replica.http`), with a routing key for prefix affinity.
  A JSON answer is read to its end before it is sent, so a replica that dies meanwhile costs the client nothing:
  the request is sent again (`ATTEMPTS` in all, `RESUME_ATTEMPTS` with failover; Serve routes it to a live one):
  the same answer for greedy and seeded requests, a fresh sample of the same distribution otherwise. Out of
  attempts: 503 with Retry-After.
- A stream of one choice is relayed as it comes, and its failover kept (`Failover`, with `ScaleConfig.failover`):
  the replica reports each event's tokens (server/resume.py; the reports never reach the client); when it dies,
  the stream goes on in another replica, which runs the same request after those tokens (`x-verispec-resume`)
  and streams the rest under the same id: no token lost or repeated, greedy and seeded outputs and logprobs as
  if nothing happened. A stream no replica can take up, and with `--no-failover` any stream cut by a dead
  replica, ends with a retryable error event (503, `replica_unavailable`) and `[DONE]`.
- `/health` answers here: how many replicas are ready (Serve routes only to those: a replica still loading its
  model takes no request), 503 when none is.
- `/metrics` and `GET /v1/stats` gather each replica's own registry (pinned calls, router.py) and merge them
  (aggregate.py), plus the ingress's counters (requests, retries, replica failures).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace

import ray
from fastapi import FastAPI, Request
from ray import serve
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from ray.exceptions import ActorUnavailableError, RayActorError

from ..config import ServerConfig
from ..errors import APIError, install_error_handlers
from ..guard import install_guard
from ..responses import DONE, sse
from ..resume import PRIVATE_HEADERS, PROGRESS_HEADER, RESUME_HEADER, read_progress, resume_header
from . import aggregate
from .bridge import HttpCall
from .config import ScaleConfig
from .routing import generation_body, resumable, routing_key

logger = logging.getLogger("verispec.server")
APP_NAME = "verispec"
REPLICA_DEPLOYMENT = "Replica"
REPLICA_HEADER = "x-verispec-replica"  # which replica answered (tests, debugging)
ATTEMPTS = 3  # tries of a request whose replica died before it answered
RESUME_ATTEMPTS = 8  # tries to pick a stream up after its replica died (each on a replica not seen dead)
RESUME_WAIT_S = 60.0  # bound on waiting for a replica to pick a stream up (Serve waits for one to be ready)
SCRAPE_TIMEOUT_S = 15.0  # bound on one replica's metrics answer (it comes between two engine steps)
_GENERATIONS = {"/v1/chat/completions", "/v1/completions"}
_LOST = (RayActorError, ActorUnavailableError)  # the replica died or cannot be reached
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection"}


def replica_unavailable(detail: str) -> APIError:
    return APIError(503, f"No replica could answer: {detail}. Retry the request.", type="server_error",
                    code="replica_unavailable", headers={"Retry-After": "1"})


class IngressMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("verispec_ingress_requests", "Requests answered by the ingress, by endpoint and "
                                "HTTP status (streams: the status they started with)", ["endpoint", "status"],
                                registry=r)
        self.replica_failures = Counter("verispec_replica_failures", "Calls to a replica that died or could not "
                                        "be reached", registry=r)
        self.retries = Counter("verispec_retried_requests", "Requests sent again to another replica after theirs "
                               "died before answering", registry=r)
        self.cut_streams = Counter("verispec_cut_streams", "Streams ended with a retryable error because their "
                                   "replica died (no failover, or no replica could pick them up)", registry=r)
        self.resumed_streams = Counter("verispec_resumed_streams", "Streams picked up by another replica after "
                                       "theirs died (failover)", registry=r)


class Ingress:
    def __init__(self, replicas, config: ServerConfig, scale: ScaleConfig) -> None:
        self.replicas = replicas  # DeploymentHandle of the Replica deployment
        self.config = config
        self.scale = scale
        self.metrics = IngressMetrics()
        self.generations = 0  # generation requests in flight here
        self.live = scale.replicas  # replicas seen at the latest look
        self.scraped: dict[str, str] = {}  # replica id -> its latest /metrics text (a dead one's stays)
        self.gate = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self)

    def queue_full(self) -> bool:
        return self.generations >= self.live * self.config.max_num_seqs + self.config.max_queued_requests

    def live_replicas(self) -> list[str]:
        """Ids of the Replica deployment's running actors (their names: SERVE_REPLICA::app#deployment#id)."""
        prefix = f"SERVE_REPLICA::{APP_NAME}#{REPLICA_DEPLOYMENT}#"
        ids = [a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith(prefix)]
        self.live = max(1, len(ids))
        return ids

    async def gather(self) -> tuple[dict, list[str], list[str]]:
        """-> (merged families, live replica ids, retired replica ids)."""
        live = []
        # One after the other: calls made while answering one HTTP request share Serve's internal request id,
        # and Serve's router matches a chosen replica to a pending call by that id, so concurrent pinned calls
        # could swap replicas.
        for rid in self.live_replicas():
            try:
                answered, text = await asyncio.wait_for(self.replicas.metrics.remote(replica=rid), SCRAPE_TIMEOUT_S)
            except (TimeoutError, *_LOST) as exc:
                logger.warning("replica %s: its metrics did not come (%r)", rid, exc)
                continue
            self.scraped[answered] = text
            live.append(answered)
        retired = sorted(set(self.scraped) - set(live))
        return aggregate.merge(self.scraped, frozenset(retired)), sorted(live), retired

    async def readiness(self) -> dict[str, int]:
        """-> replicas by state, from Serve's status (asked off the event loop): "RUNNING" ones are ready (Serve
        routes requests only to them), "STARTING" ones are loading their model."""
        def ask() -> dict[str, int]:
            try:
                app = serve.status().applications.get(APP_NAME)
            except Exception as exc:  # noqa: BLE001 - Serve's controller unreachable: nothing known to be ready
                logger.warning("Serve's status did not come (%r)", exc)
                return {}
            deployment = None if app is None else app.deployments.get(REPLICA_DEPLOYMENT)
            states = {} if deployment is None else deployment.replica_states
            return {str(getattr(state, "value", state)): n for state, n in states.items()}

        return await asyncio.to_thread(ask)

    async def set_failover(self, on: bool) -> None:
        """Switch failover on or off for the requests that come next (the tests' negative control)."""
        self.scale = replace(self.scale, failover=on)

    async def drain(self, timeout: float) -> int:
        """New requests get 503; waits up to `timeout` s for those in flight. -> how many are still there."""
        self.gate.draining = True
        deadline = time.monotonic() + timeout
        while self.gate.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.gate.in_flight

    # -- forwarding ----------------------------------------------------------------------------------------------

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        scope = request.scope
        headers = tuple((k, v) for k, v in scope["headers"] if k.lower() not in PRIVATE_HEADERS)  # the ingress's own
        call = HttpCall(request.method, scope["path"], scope.get("query_string", b""), headers, body)
        data = generation_body(call.path, body)
        key = routing_key(call.path, body, self.scale.prefix_chars, data)
        failover = self.scale.failover and resumable(data)
        if failover:  # the replica reports each event's tokens
            call = replace(call, headers=headers + ((PROGRESS_HEADER.encode(), b"1"),))
        endpoint = call.path if call.path.startswith("/v1/") or call.path == "/health" else "other"
        generation = call.path in _GENERATIONS
        self.generations += int(generation)
        relayed = False  # a stream's relay took the request over: it gives the place back
        attempts = RESUME_ATTEMPTS if self.scale.failover else ATTEMPTS
        try:
            for attempt in range(attempts):
                if attempt:
                    self.metrics.retries.inc()
                stream = self.replicas.options(stream=True).http.remote(call, key=key)
                try:
                    head = await stream.__anext__()
                    headers = {k: v for k, v in head["headers"] if k.lower() not in _HOP_HEADERS}
                    headers[REPLICA_HEADER] = head["replica"]
                    if headers.get("content-type", "").startswith("text/event-stream"):
                        self.metrics.requests.labels(endpoint, str(head["status"])).inc()
                        relayed = True
                        if failover and head["status"] == 200:
                            return Failover(self, call, key, head["replica"], stream, lambda: self._done(generation),
                                            status_code=200, headers=headers)
                        return Relay(stream, self.metrics, lambda: self._done(generation), status_code=head["status"],
                                     headers=headers)
                    content = b"".join([chunk async for chunk in stream])
                    self.metrics.requests.labels(endpoint, str(head["status"])).inc()
                    return Response(content, status_code=head["status"], headers=headers)
                except _LOST:
                    self.metrics.replica_failures.inc()
                except BaseException:
                    stream.cancel()
                    raise
            raise replica_unavailable(f"{attempts} replicas in a row went away while answering")  # counted there
        finally:
            if not relayed:
                self._done(generation)

    def _done(self, generation: bool) -> None:
        self.generations -= generation

    async def resume(self, call: HttpCall, key: str | None, avoid: list[str]) -> tuple[object, dict] | None:
        """Send a stream's request (its resume header added) to a replica not in `avoid`. -> (its stream, its head),
        or None when none could take it."""
        deadline = time.monotonic() + RESUME_WAIT_S
        for _ in range(RESUME_ATTEMPTS):
            stream = self.replicas.options(stream=True).http.remote(call, key=key, avoid=tuple(avoid))
            try:
                head = await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - time.monotonic()))
            except _LOST:
                self.metrics.replica_failures.inc()
                continue
            except TimeoutError:
                stream.cancel()
                return None
            except BaseException:
                stream.cancel()
                raise
            return stream, head
        return None


class Relay(StreamingResponse):
    """A replica's stream relayed to the client. However the response ends (read to its end, cut by a dead
    replica, or its client gone, even before the first chunk: then the body's generator never starts), `done()`
    runs exactly once, and a stream not read to its end is cancelled at the replica (its app sees the client
    disconnect)."""

    def __init__(self, stream, metrics: IngressMetrics, done, **kwargs) -> None:
        self.stream, self.metrics, self.done = stream, metrics, done
        self.finished = False
        super().__init__(self._chunks(), **kwargs)

    async def _chunks(self):
        try:
            async for chunk in self.stream:
                yield chunk
        except _LOST:
            self.metrics.replica_failures.inc()
            self.metrics.cut_streams.inc()
            yield sse(replica_unavailable("the replica running this stream went away").body()) + DONE
        self.finished = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.done()
            if not self.finished:
                self.stream.cancel()


class Failover(Relay):
    """A stream of one choice that outlives its replica. The replica's progress reports (server/resume.py) are taken
    off each event and kept: the tokens streamed, the characters of their text shown, and whether the choice has
    finished. When the replica dies, the request goes to another replica with those (`x-verispec-resume`), which
    streams what follows under the stream's id and `created` (read off its first event); the client sees one
    stream. Nothing is parsed but the reports and the first event."""

    def __init__(self, ingress: Ingress, call: HttpCall, key: str | None, replica: str, stream, done,
                 **kwargs) -> None:
        self.ingress, self.call, self.key, self.replica = ingress, call, key, replica
        self.tokens: list[int] = []  # streamed, in order
        self.shown = 0  # characters of their text shown
        self.ended = False  # the choice's finish event came (with the usage event and [DONE], in one piece)
        self.identified = False  # the first event came: it has the stream's id and created
        self.id: str | None = None
        self.created = 0
        super().__init__(stream, ingress.metrics, done, **kwargs)

    async def _chunks(self):
        gone: list[str] = []
        while True:
            try:
                async for item in self.stream:
                    report, item = read_progress(item)
                    if report is not None:
                        self.tokens += report["t"]
                        self.shown = report.get("s", self.shown)
                        self.ended = self.ended or "f" in report
                    if not self.identified and item.startswith(b"data: {"):  # its first event: the one parsed
                        first = json.loads(item[6:].partition(b"\n")[0])
                        self.identified = True
                        self.id, self.created = first.get("id"), first.get("created", 0)
                    if item:
                        yield item
                self.finished = True
                return
            except _LOST:
                self.metrics.replica_failures.inc()
            gone.append(self.replica)
            if self.ended:
                yield DONE.encode()
                self.finished = True
                return
            picked = await self._pick_up(gone)
            if picked is None:
                self.metrics.cut_streams.inc()
                yield sse(replica_unavailable("the replica running this stream went away and no other could "
                                              "pick it up").body()) + DONE
                self.finished = True
                return
            self.metrics.resumed_streams.inc()

    async def _pick_up(self, gone: list[str]):
        """Another replica's stream going on from where this one is; None when none could take it up."""
        call = self.call
        if self.identified or self.tokens:
            resume = resume_header(self.id or "", self.created, self.tokens, self.shown)
            call = replace(call, headers=call.headers + ((RESUME_HEADER.encode(), resume),))
        picked = await self.ingress.resume(call, self.key, gone)
        if picked is None:
            return None
        self.stream, head = picked
        if head["status"] != 200:  # refused (a 400 would be an ingress fault): its error ends the stream
            logger.error("a replica refused to resume a stream: %s", b"".join([c async for c in self.stream]))
            return None
        self.replica = head["replica"]
        return self.stream


def build_app(ingress: Ingress) -> FastAPI:
    app = FastAPI(title="verispec", summary="OpenAI-compatible server with speculative decoding, on Ray Serve")

    def count_error(request: Request, status: int) -> None:
        path = request.url.path
        ingress.metrics.requests.labels(path if path.startswith("/v1/") else "other", str(status)).inc()

    install_error_handlers(app, on_error=count_error)
    ingress.gate = install_guard(app, ingress.config, on_reject=count_error, queue_full=ingress.queue_full)

    @app.get("/health")
    async def health() -> JSONResponse:
        states = await ingress.readiness()
        ready = states.get("RUNNING", 0)
        body = {"status": "ok" if ready else "unavailable",
                "replicas": {"ready": ready, "starting": states.get("STARTING", 0), "by_state": states}}
        ingress.metrics.requests.labels("/health", "200" if ready else "503").inc()
        return JSONResponse(body, status_code=200 if ready else 503, headers=None if ready else {"Retry-After": "1"})

    @app.get("/metrics")
    async def metrics() -> Response:
        families, _, _ = await ingress.gather()
        text = aggregate.render(families) + generate_latest(ingress.metrics.registry).decode()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/stats")
    async def stats() -> JSONResponse:
        families, live, retired = await ingress.gather()
        total = aggregate.totals(families)
        own = {f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
               for family in ingress.metrics.registry.collect() for s in family.samples
               if not s.name.endswith("_created")}
        return JSONResponse({"replicas": {"live": live, "retired": retired}, "summary": aggregate.summary(total),
                             "totals": total, "by_replica": aggregate.per_replica(families), "ingress": own})

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
                   include_in_schema=False)
    async def forward(request: Request) -> Response:
        return await ingress.forward(request)

    return app
