"""What stands between the network and the API: the API key, the body size limit, and admission while draining.

One pure ASGI middleware, in front of every route (a streamed response passes through it untouched):

- a POST body is read here first, up to `max_request_bytes`; a larger one is read to its end and dropped (so the
  client, still sending, sees the 413 instead of a reset connection; past `DRAIN_FACTOR` times the limit the
  connection is closed instead), then the route gets the body as if nothing had read it;
- while the server drains for shutdown (`Gate.draining`), every /v1 request and /health get a 503;
- with an API key, every /v1 request must carry `Authorization: Bearer <key>`, else a 401. /health and /metrics
  stay open: load balancers and Prometheus probe them without the key (neither says anything about requests);
  so does / (the playground: a static page whose calls to /v1 send the key its user types);
- while `max_queued_requests` requests wait for a slot, a new generation request gets its 429 here, before any
  parsing, so refusing a burst costs the event loop next to nothing (the worker's `submit` checks again);
- `Gate.in_flight` counts the /v1 requests being answered, streams until their last byte: the shutdown drain
  waits for it to reach zero.

`document` adds what this middleware answers (401, 413, 503) and the routes' other statuses (408, 429, and the
SSE form of a 200) to the OpenAPI schema, so a client or a fuzzer (tests/server/test_server_fuzz.py) reading it knows
every answer it can get.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import FastAPI, Request

from .config import ServerConfig
from .errors import APIError, queue_full, shutting_down

DRAIN_FACTOR = 16  # a body over the limit is read (and dropped) up to this many times the limit
_BODY_METHODS = {"POST", "PUT", "PATCH"}
_GENERATIONS = {"/v1/chat/completions", "/v1/completions"}


class Gate:
    """Admission state shared by the middleware and the shutdown drain (both on the event loop)."""

    def __init__(self) -> None:
        self.draining = False  # set on SIGTERM / SIGINT: new /v1 requests get a 503
        self.in_flight = 0  # /v1 requests being answered


class _ClientGone(Exception):
    pass


class GuardMiddleware:
    def __init__(self, app, config: ServerConfig, gate: Gate, on_reject: Callable[[Request, int], None],
                 queue_full: Callable[[], bool]) -> None:
        self.app = app
        self.config = config
        self.limit = config.max_request_bytes
        self.key = None if config.api_key is None else config.api_key.encode()
        self.gate = gate
        self.on_reject = on_reject  # told (request, status) of every request refused here (metrics)
        self.queue_full = queue_full

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        api = path == "/v1" or path.startswith("/v1/")
        error, body = None, None
        if scope["method"] in _BODY_METHODS:
            try:
                body = await self._read_body(scope, receive)
            except _ClientGone:
                return
            if body is None:
                error = APIError(413, f"The request body is larger than this server's limit of {self.limit} bytes "
                                      "(--max-request-bytes).", code="request_too_large",
                                 headers={"Connection": "close"})
        if self.gate.draining and (api or path == "/health"):
            error = shutting_down()
        elif api and self.key is not None:
            error = self._check_key(scope) or error
        if error is None and path in _GENERATIONS and self.queue_full():
            error = queue_full(self.config.max_queued_requests)
        if error is not None:
            self.on_reject(Request(scope), error.status)
            await error.response()(scope, receive, send)
            return
        if body is not None:
            receive = _replay(body, receive)
        if not api:
            await self.app(scope, receive, send)
            return
        self.gate.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.in_flight -= 1

    async def _read_body(self, scope, receive) -> bytes | None:
        """The whole body, or None when it is over the limit (then read to its end and dropped, unless it says
        or turns out to be over DRAIN_FACTOR times the limit)."""
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > DRAIN_FACTOR * self.limit:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.limit:
                chunks.append(chunk)
            if not message.get("more_body") or size > DRAIN_FACTOR * self.limit:
                return b"".join(chunks) if size <= self.limit else None

    def _check_key(self, scope) -> APIError | None:
        given = dict(scope["headers"]).get(b"authorization")
        if given is not None:
            scheme, _, token = given.partition(b" ")
            if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
                return None
        what = "You didn't provide an API key" if given is None else "Incorrect API key provided"
        return APIError(401, f"{what}. Send it as the header `Authorization: Bearer <key>` (the key the server "
                             "was started with, --api-key).", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})


def _replay(body: bytes, receive):
    """`receive` that hands the route the body read already, then whatever the connection says next."""
    sent = False

    async def replayed():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def install_guard(app: FastAPI, config: ServerConfig, on_reject: Callable[[Request, int], None],
                  queue_full: Callable[[], bool]) -> Gate:
    """Put the guard in front of every route and into the OpenAPI schema. -> its Gate."""
    gate = Gate()
    app.add_middleware(GuardMiddleware, config=config, gate=gate, on_reject=on_reject, queue_full=queue_full)
    document(app, config)
    return gate


def document(app: FastAPI, config: ServerConfig) -> None:
    """The statuses the guard and the limits add, and the SSE form of a 200, in the app's OpenAPI schema."""
    build = app.openapi
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        statuses = {"503": "The server is shutting down"}
        if config.api_key is not None:
            statuses["401"] = "Missing or wrong API key"
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        posts = {"408": "The request ran past --request-timeout", "413": "The body is over --max-request-bytes",
                 "429": "--max-queued-requests requests already wait (see Retry-After)"}
        for path, operations in schema["paths"].items():
            for method, operation in operations.items():
                responses = operation["responses"]
                responses.pop("422", None)  # FastAPI's default; validation errors are 400s here
                if path == "/health" or path.startswith("/v1"):
                    added = {**statuses, **(posts if method == "post" else {})}
                    for status, description in added.items():
                        responses[status] = {"description": description, "content": error}
                if path.startswith("/v1") and config.api_key is not None:
                    operation["security"] = [{"bearer": []}]
                if method == "post":
                    # With "stream": true: events of the chunk objects, then `data: [DONE]` (docs/server.md).
                    responses["200"].setdefault("content", {})["text/event-stream"] = {}
                if path == "/metrics":
                    responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
