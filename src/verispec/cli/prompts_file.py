"""`verispec generate --prompts-file`: JSON lines in, JSON lines out, all prompts run together as one batch.

Each input line is an object with exactly one of "prompt" (text), "messages" (chat messages, through the chat
template) or "prompt_token_ids", an optional "id", and optional per-prompt sampling fields (any SamplingParams
field: max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty,
frequency_penalty, seed, stop, stop_token_ids, min_new_tokens, ignore_eos) that override the command line's.
Each output line, in input order: id, index, text, token_ids, finish_reason, stats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from ..config import SamplingParams
from . import CliError

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
SAMPLING_KEYS = {f.name for f in fields(SamplingParams)}


@dataclass
class PromptLine:
    id: object
    prompt: object  # text, messages or token ids
    chat: bool
    params: SamplingParams


def read_prompts_file(path: Path, defaults: dict, chat: bool) -> list[PromptLine]:
    """Parse and validate every line before any model is loaded; a bad line is a CliError naming it."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CliError(f"--prompts-file {path}: {exc.strerror or exc}") from None
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts-file {path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise CliError(f"{where}: each line must be a JSON object")
        given = [key for key in PROMPT_KEYS if key in row]
        if len(given) != 1:
            raise CliError(f"{where}: give exactly one of {', '.join(PROMPT_KEYS)}")
        unknown = sorted(set(row) - set(PROMPT_KEYS) - SAMPLING_KEYS - {"id"})
        if unknown:
            raise CliError(f"{where}: unknown field(s) {', '.join(unknown)}; sampling fields are "
                           f"{', '.join(sorted(SAMPLING_KEYS))}")
        overrides = {key: tuple(value) if isinstance(value, list) else value
                     for key, value in row.items() if key in SAMPLING_KEYS}
        try:
            params = SamplingParams(**{**defaults, **overrides})
        except (TypeError, ValueError) as exc:
            raise CliError(f"{where}: {exc}") from None
        key = given[0]
        prompt = row[key]
        valid = {"prompt": isinstance(prompt, str),
                 "messages": isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt),
                 "prompt_token_ids": isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)}[key]
        if not valid or not prompt:
            raise CliError(f"{where}: {key} must be a non-empty "
                           + {"prompt": "string", "messages": "list of messages", "prompt_token_ids": "list of ints"}[key])
        out.append(PromptLine(row.get("id", len(out)), prompt, chat or key == "messages", params))
    if not out:
        raise CliError(f"--prompts-file {path}: no prompts in the file")
    return out


def result_line(line: PromptLine, index: int, result, tokenizer=None) -> str:
    out = {"id": line.id, "index": index, "text": result.text, "token_ids": result.token_ids,
           "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}
    if result.logprobs is not None:
        out["logprobs"] = logprobs_json(result.logprobs, tokenizer)
    return json.dumps(out)


def logprobs_json(logprobs, tokenizer=None) -> list[dict]:
    """One entry per generated token: its id, text, logprob and the alternatives asked for."""

    def text(token_id: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token_id])

    return [{"token_id": lp.token_id, "token": text(lp.token_id), "logprob": lp.logprob,
             "top_logprobs": [{"token_id": t, "token": text(t), "logprob": v} for t, v in lp.top]}
            for lp in logprobs]
