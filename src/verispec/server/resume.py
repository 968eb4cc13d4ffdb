"""A stream that goes on in another process: what a replica reports as it streams, and how it picks a stream up.

Behind the replicas' ingress (server/scale/ingress.py) a stream whose replica dies goes on in another replica,
as if nothing happened. Two private headers, which only the ingress sends (it drops them from a client's request):

- `x-verispec-progress: 1`: the replica reports, in front of each streamed event that carries tokens, an SSE
  comment line (`: vs {...}`; an SSE client ignores comments, and the ingress strips them) with the event's
  token ids (`t`), the characters of the text shown so far (`s`), and `f` on the choice's finish event, which
  comes in one piece with the usage event and `[DONE]` (a death never splits them). A round whose
  text is held back (a possible stop string, a split character) is reported by a comment alone.
- `x-verispec-resume: {...}`: the stream to pick up: its `id` and `created` (an empty id: no event was sent yet,
  the replica gives its own), the tokens already streamed and the characters of their text shown. The replica
  runs the same request from there (`engine.Continuation`: the tokens count as output for penalties, min_tokens,
  the grammar and the coupled noise's positions), streams only what follows under the same id, with no role
  chunk again, and counts the tokens in `usage`.

A stream of one choice only (one prompt, n = 1) can be resumed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..engine import Continuation
from .errors import invalid

PROGRESS_HEADER = "x-verispec-progress"
RESUME_HEADER = "x-verispec-resume"
PRIVATE_HEADERS = (PROGRESS_HEADER.encode(), RESUME_HEADER.encode())
_PREFIX = b": vs "


@dataclass(frozen=True)
class Resume:
    """A stream picked up where another replica left it."""

    id: str  # the stream's id, kept
    created: int  # its `created`, kept
    continuation: Continuation  # the tokens streamed and the characters of their text shown


def parse_resume(header: str | None) -> Resume | None:
    """The `x-verispec-resume` header -> Resume (None when absent); a 400 when it is not one."""
    if header is None:
        return None
    try:
        data = json.loads(header)
        ids = tuple(int(t) for t in data["tokens"])
        return Resume(str(data["id"]), int(data["created"]), Continuation(ids, int(data["shown"])))
    except (ValueError, KeyError, TypeError) as exc:
        raise invalid(f"{RESUME_HEADER} is not a stream to resume ({exc}).") from exc


def resume_header(stream_id: str, created: int, token_ids: list[int], shown: int) -> bytes:
    return json.dumps({"id": stream_id, "created": created, "tokens": token_ids, "shown": shown},
                      separators=(",", ":")).encode()


def progress_line(token_ids: list[int], shown: int) -> str:
    """The comment in front of a streamed event: its tokens and the characters of the choice's text shown."""
    return f": vs {json.dumps({'t': token_ids, 's': shown}, separators=(',', ':'))}\n"


FINISHED_LINE = ': vs {"t":[],"f":1}\n'  # in front of the choice's finish event


def read_progress(item: bytes) -> tuple[dict | None, bytes]:
    """A streamed body piece -> (its progress report or None, the piece the client gets)."""
    if not item.startswith(_PREFIX):
        return None, item
    line, _, rest = item.partition(b"\n")
    return json.loads(line[len(_PREFIX):]), (b"" if rest == b"\n" else rest)
