"""Which replica a request goes to: prefix affinity by rendezvous hashing, else the least loaded. Pure.

The key is the start of the prompt's text (a chat's messages as the template will see them, a completion's
prompt), so requests sharing a system prompt or a long common start share a key and land where that prefix's KV
is cached. Rendezvous (highest random weight) hashing: each replica's score is a hash of (key, replica id), the
highest wins, so when a replica leaves or joins only the keys it owned move. A preferred replica much busier than
the least busy one (`imbalance` ongoing requests more) loses the request to the least loaded: affinity never
piles a hot prefix onto one replica while others idle.
"""

from __future__ import annotations

import hashlib
import json

_GENERATIONS = ("/v1/chat/completions", "/v1/completions")


def generation_body(path: str, body: bytes) -> dict | None:
    """A generation request's JSON body; None for another path or a body that is not a JSON object."""
    if path not in _GENERATIONS:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def resumable(data: dict | None) -> bool:
    """Whether a generation request (its `generation_body`) is a stream of one choice: one prompt, n = 1, which a
    failover can pick up on another replica (server/resume.py)."""
    if data is None or data.get("stream") is not True or data.get("n", 1) not in (1, None):
        return False
    prompt = data.get("prompt")
    return not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int) or len(prompt) == 1


def routing_key(path: str, body: bytes, chars: int, data: dict | None = None) -> str | None:
    """The affinity key of a request: its prompt's first `chars` characters; None when it has no prompt. `data`:
    the body already parsed (`generation_body`)."""
    data = generation_body(path, body) if data is None else data
    if data is None:
        return None
    if path == _GENERATIONS[0]:
        messages = data.get("messages")
        if not isinstance(messages, list):
            return None
        text = "".join(f"{m.get('role')}\n{_content(m.get('content'))}\n" for m in messages if isinstance(m, dict))
    else:
        prompt = data.get("prompt")
        if not prompt:
            return None
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    return text[:chars] or None


def _content(content) -> str:
    if isinstance(content, list):  # content parts: their texts in order
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content or "")


def preference(key: str, replicas: list[str]) -> list[str]:
    """The replicas in the key's order of preference (rendezvous hashing: stable under membership changes)."""
    def score(replica: str) -> bytes:
        return hashlib.blake2b(f"{replica}\0{key}".encode(), digest_size=8).digest()

    return sorted(replicas, key=score, reverse=True)


def rank(key: str | None, loads: dict[str, int | None], imbalance: int) -> list[list[str]]:
    """Ranks of replicas to try, best first, for a request with `key`; `loads`: ongoing requests per replica
    (None: not known yet). Serve takes the least loaded replica within the first rank that has room."""
    replicas = list(loads)
    if key is None or len(replicas) < 2:
        return [replicas]
    first, *others = preference(key, replicas)
    # An unknown load counts as idle: Serve probes only the replicas of the rank it tries, so with affinity alone
    # the others' loads would never become known and a hot prefix (a shared system prompt) would pile onto one.
    floor = min(0 if loads[r] is None else loads[r] for r in others)
    if loads[first] is not None and loads[first] - floor > imbalance:
        return [replicas]  # the preferred replica is much busier: least loaded wins (Serve probes the unknown)
    return [[first], others]
