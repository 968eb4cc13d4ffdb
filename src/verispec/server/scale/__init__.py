"""Past one process: `verispec serve --replicas N` on Ray Serve (docs/server.md, "Scaling out").

Each replica is one engine: the single-process server's app (`server.app.create_app`) run in-process inside a
Ray Serve replica (`replica.py`, through `bridge.py`). One ingress deployment (`ingress.py`) receives every HTTP
request, applies the same guard (API key, body limit, queue bound, drain), picks a replica through Serve's
request-router extension point (`router.py`: prefix affinity by rendezvous hashing of the prompt's start, else
least loaded; the choice itself is `routing.py`, pure), retries a request whose replica died before it answered
and carries a stream whose replica died on in another replica from its tokens so far (failover, server/resume.py;
with `--no-failover`, a retryable 503 error event ends it). `/metrics` and `GET /v1/stats` sum
every replica's counters and histograms (`aggregate.py`). `launch.py` starts (or joins) Ray and Serve.

Only `config.py`, `routing.py`, `aggregate.py` and `bridge.py` import without Ray; the rest needs the `ray`
extra (`pip install "verispec[ray]"`).
"""
