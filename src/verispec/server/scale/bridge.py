"""An HTTP request answered by an ASGI app in this process, its response handed back piece by piece.

A replica runs the single-process server's app unchanged (routes, guard, errors, SSE): the ingress ships the
request over (`HttpCall`) and `answer` plays it into the app, yielding the response's head (`{"status",
"headers"}`) and then its body chunks as the app sends them, so a stream stays a stream across processes. When
the consumer stops early (the client went away, or the ingress gave up), the app is told the client
disconnected: the request leaves the batch as it does in one process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class HttpCall:
    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


_running: set[asyncio.Task] = set()  # apps still finishing after their consumer left (the loop holds tasks weakly)


async def answer(app, call: HttpCall) -> AsyncIterator[dict | bytes]:
    """-> the response head `{"status": int, "headers": [(name, value)]}`, then each non-empty body chunk."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": call.method, "scheme": "http", "path": call.path, "raw_path": call.path.encode(),
        "query_string": call.query, "root_path": "", "headers": list(call.headers),
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }
    task = asyncio.ensure_future(app(scope, receive, send))
    _running.add(task)
    task.add_done_callback(_running.discard)
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while True:
            message = await messages.get()
            if message is None:  # the app returned (or raised) without finishing its response
                task.result()
                raise RuntimeError("the app ended without a complete response")
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message["headers"]]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    return
    finally:
        gone.set()  # a consumer that left early is a client that disconnected
