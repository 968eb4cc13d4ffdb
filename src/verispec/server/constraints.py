"""Request fields that shape the target's distribution or its output, turned into SamplingParams terms: logprobs,
logit_bias, structured output (response_format and vLLM's guided_* fields), and the 400 for OpenAI fields
verispec does not implement. Each raises an OpenAI-style 400 naming the field."""

from __future__ import annotations

import json

from ..config import StructuredOutput
from .errors import invalid
from .protocol import (
    CHAT_ONLY_FIELDS,
    COMPLETION_ONLY_FIELDS,
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    SamplingFields,
)

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def check_supported(body: SamplingFields) -> None:
    """A request that sets an unimplemented OpenAI field (audio, ...; tools on a text completion) gets a 400
    instead of an answer that silently ignores it. Empty and false values (`"tools": []`, `"store": false`) ask
    for nothing and pass."""
    chat = isinstance(body, ChatCompletionRequest)
    for name in UNSUPPORTED_FIELDS + (COMPLETION_ONLY_FIELDS if chat else CHAT_ONLY_FIELDS):
        if getattr(body, name, None):
            where = "use POST /v1/chat/completions" if name in CHAT_ONLY_FIELDS else \
                "use POST /v1/completions" if name in COMPLETION_ONLY_FIELDS else \
                "see docs/server.md, \"Supported fields\""
            raise invalid(f"`{name}` is not supported by this endpoint ({where}).", param=name)


def requested_logprobs(body: SamplingFields) -> int | None:
    """Alternatives per token to return (0: only the chosen token's logprob), or None for no logprobs."""
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs needs logprobs set to true.", param="top_logprobs")
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def logit_bias(body: SamplingFields, vocab_size: int) -> dict[int, float]:
    """OpenAI's map of token ids (strings) to biases, checked against the model's vocabulary (SamplingParams checks
    the values)."""
    out = {}
    for key, bias in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise invalid(f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise invalid(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size}).",
                          param="logit_bias")
        out[token] = bias
    return out


def structured_output(body: SamplingFields, tool_grammar: str | None = None) -> StructuredOutput | None:
    """The output constraint of `response_format` or one guided_* field (at most one may be given), or of the
    request's tools (`tool_grammar`, the Lark grammar of its calls: server/tools/), which exclude the others."""
    given = [name for name in _GUIDED if getattr(body, name) is not None]
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        given.insert(0, "response_format")
    if tool_grammar is not None:
        if given:
            raise invalid(f"{given[0]} cannot be combined with tools (their calls have their own grammar); "
                          "leave it out, or set tool_choice to none.", param=given[0])
        return StructuredOutput("grammar", tool_grammar)
    if len(given) > 1:
        raise invalid(f"give one output constraint, not {' and '.join(given)}.", param=given[1])
    if not given:
        return None
    if given[0] == "response_format":
        if fmt.type == "json_object":
            return StructuredOutput("json_object")
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid("response_format json_schema needs json_schema.schema.", param="response_format")
        return StructuredOutput("json_schema", json.dumps(fmt.json_schema.schema_))
    if body.guided_json is not None:
        schema = body.guided_json
        return StructuredOutput("json_schema", schema if isinstance(schema, str) else json.dumps(schema))
    if body.guided_regex is not None:
        return StructuredOutput("regex", body.guided_regex)
    if body.guided_choice is not None:
        return StructuredOutput("choice", choices=tuple(body.guided_choice))
    return StructuredOutput("grammar", body.guided_grammar)


def constraint_param(params) -> str:
    """The request field a SamplingParams' constraint came from, named in the errors the engine raises for it
    (the worker has the SamplingParams, no longer the request body)."""
    return "response_format" if params.structured is not None else "logit_bias"


def constraint_field(body: SamplingFields, field: str) -> str:
    """The request field behind a SamplingParams error about `field` (its first word)."""
    if field == "structured":
        given = [name for name in ("response_format", *_GUIDED) if getattr(body, name) is not None]
        return given[0] if given else "tools" if getattr(body, "tools", None) else field
    return field
