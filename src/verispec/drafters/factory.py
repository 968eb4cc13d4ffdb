"""The earlier names of drafter building, kept for callers and tests that use them: the parser is spec.py, the one
builder build.py. `make_drafter(name, ...)` is `build_drafter(name, ..., on_error="raise").drafter`."""

from __future__ import annotations

from .build import build_drafter, check_vocab_match, model_drafter
from .named import NAMED_DRAFTERS
from .spec import AUTO, DEFAULT_HEAD, DEFAULT_HEAD_DIR, NONE, head_path, parse_drafter_spec

__all__ = ["AUTO", "DEFAULT_HEAD", "DEFAULT_HEAD_DIR", "NAMED_DRAFTERS", "NONE", "cascade_parts",
           "check_vocab_match", "head_path", "make_drafter", "model_drafter", "model_part"]


def cascade_parts(name: str | None) -> list[str]:
    """The drafter values a '+' list names ([name] when it is one value; a path that exists is never split)."""
    spec = parse_drafter_spec(name)
    return [stage.name for stage in spec.stages] or [NONE]


def model_part(name: str | None) -> str | None:
    """The draft model a drafter value names, if any ('ngram+MODEL' -> 'MODEL'; 'ngram' -> None)."""
    return parse_drafter_spec(name).model


def make_drafter(name, target, tokenizer, max_len: int, dtype=None, device=None, draft_model=None):
    """The drafter `name` names for `target` (None or 'none': no drafter); max_len is the user's (build.py)."""
    return build_drafter(name, target, tokenizer, max_len, dtype=dtype, device=device, draft_model=draft_model).drafter
