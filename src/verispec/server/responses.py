"""Response bodies and server-sent-event chunks in OpenAI's formats, for chat and for text completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ..config import SpeculativeConfig
from ..drafters.prediction import NAME as PREDICTION
from ..engine import TokenLogprob, TokenOrigin
from ..stats import GenerationStats
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    Delta,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    CompletionTokensDetails,
    SpeculativeMetrics,
    TokenLogprobEntry,
    ToolCall,
    TopLogprob,
    Usage,
)
from .tools import CallDelta, Output, new_call_id

DONE = "data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token the sampling transforms removed reports this (as vLLM does)


@dataclass
class TokenText:
    """A token's logprob with the token and its alternatives as text (decoded on the model thread); an echoed
    prompt's first token has neither (None)."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None


def decode_logprobs(logprobs: list[TokenLogprob], tokenizer) -> list[TokenText]:
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return [TokenText(text(lp.token_id), max(lp.logprob, LOGPROB_FLOOR),
                      [(text(t), max(value, LOGPROB_FLOOR)) for t, value in lp.top]) for lp in logprobs]


def annotate(token_ids: list[int], origins: list[TokenOrigin], tokenizer) -> list[dict]:
    """The `verispec.tokens` of an annotated chunk: per committed token its id, its text (decoded alone; empty for
    a special token such as EOS, which the text leaves out too), how it was decided and in which round (`drafted`:
    the draft tokens that round proposed)."""
    return [{"id": token_id, "text": tokenizer.decode([token_id], skip_special_tokens=True), "origin": o.origin, "stage": o.stage,
             "round": o.round, "drafted": o.drafted} for token_id, o in zip(token_ids, origins)]


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(tokens: list[TokenText]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        TokenLogprobEntry(token=t.token, logprob=t.logprob, bytes=_utf8(t.token),
                          top_logprobs=[TopLogprob(token=a, logprob=v, bytes=_utf8(a)) for a, v in t.top])
        for t in tokens])


def completion_logprobs(tokens: list[TokenText], offset: int) -> CompletionLogprobs:
    """`offset`: characters of the choice's text before these tokens (text_offset continues from there)."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return CompletionLogprobs(tokens=[t.token for t in tokens], token_logprobs=[t.logprob for t in tokens],
                              top_logprobs=[None if t.top is None else dict(t.top) for t in tokens],
                              text_offset=offsets)


def speculative_metrics(stats: GenerationStats, draft_model: str | None, spec: SpeculativeConfig) -> SpeculativeMetrics:
    """`stats` of one choice or of all (merged); `draft_model` None when the request ran on the target alone."""
    enabled = draft_model is not None
    return SpeculativeMetrics(
        enabled=enabled,
        draft_model=draft_model,
        adaptive=enabled and spec.adaptive,
        num_draft_tokens=spec.num_draft_tokens if enabled and not spec.adaptive else None,
        acceptance_mode=stats.acceptance_mode,
        lossy=stats.lossy,
        rounds=stats.rounds,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        acceptance_rate=round(stats.acceptance_rate, 4),
        mean_accepted_length=round(stats.mean_accepted_length, 4),
        acceptance_by_position=[round(x, 4) for x in stats.acceptance_by_position],
        draft_ms=round(stats.draft_s * 1000, 3),
        verify_ms=round(stats.verify_s * 1000, 3),
        fallbacks=stats.fallbacks,
        rounds_by_stage=dict(stats.rounds_by_stage),
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          prediction: GenerationStats | None = None) -> Usage:
    """cached_tokens: of prompt_tokens (each prompt counted once), those served from the prefix cache. prediction:
    for a request with one, its choices' statistics (merged): the prediction's draft tokens accepted, and those
    proposed but not accepted (OpenAI's accepted / rejected prediction tokens; they add up to those proposed)."""
    details = None
    if prediction is not None:
        accepted = prediction.accepted_by_stage.get(PREDICTION, 0)
        rejected = prediction.draft_tokens_by_stage.get(PREDICTION, 0) - accepted
        details = CompletionTokensDetails(accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
                 completion_tokens_details=details)


def sse(chunk: ChatCompletionChunk | CompletionChunk | dict, annotation: list[dict] | None = None) -> str:
    """One event. Chunks leave out `usage` and `speculative_metrics` when empty, and deltas their unset keys,
    as OpenAI's stream does; `finish_reason` and `logprobs` stay, as null. `annotation`: the opt-in extension
    field `verispec.tokens`, after OpenAI's own fields (which it never changes)."""
    if isinstance(chunk, dict):
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
    body = chunk.model_dump(mode="json")
    for key in ("usage", "speculative_metrics"):
        if body[key] is None:
            del body[key]
    for choice in body["choices"]:
        if "delta" in choice:
            choice["delta"] = _without_nulls(choice["delta"])
    if annotation is not None:
        body["verispec"] = {"tokens": annotation}
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def _without_nulls(value):
    """A delta without its unset keys, also inside its tool calls (the client adds up what each chunk says)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def finish_reason(reason: str, called: bool) -> str:
    """OpenAI's finish reason: "tool_calls" for an answer that ended after its calls."""
    return "tool_calls" if called and reason == "stop" else reason


def tool_message(output: Output, ids: list[str] | None = None) -> AssistantMessage:
    """The message of an answer read as content and calls (`ids`: the calls' ids, given when they were streamed;
    new ones otherwise). Content is None beside calls when no text came before them, as OpenAI's."""
    if not output.calls:
        return AssistantMessage(content=output.content)
    ids = ids or [new_call_id() for _ in output.calls]
    calls = [ToolCall(id=i, function=FunctionCall(name=c.name, arguments=c.arguments)) for i, c in zip(ids, output.calls)]
    return AssistantMessage(content=output.content or None, tool_calls=calls)


def delta_tool_calls(deltas: list[CallDelta]) -> list[DeltaToolCall] | None:
    """Stream deltas of calls: a call's first one has its id, type and name (the client starts the call from it),
    later ones only the next piece of the arguments."""
    if not deltas:
        return None
    return [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                          function=DeltaFunctionCall(name=d.name, arguments=d.arguments)) for d in deltas]


class ResponseBuilder:
    """Builds one request's bodies: the full response, or its stream of chunks (same id and `created`)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.offsets: dict[int, int] = {}  # choice -> characters of its tokens streamed (completions text_offset)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _chunk(self, choices: list, **extra) -> ChatCompletionChunk | CompletionChunk:
        cls = ChatCompletionChunk if self.chat else CompletionChunk
        return cls(id=self.id, created=self.created, model=self.model, choices=choices, **extra)

    def role_chunk(self, index: int, tools: bool = False) -> str:
        """The first chunk of a chat choice: the role and empty content (chat only). An answer that may be tool calls
        leaves content out, so that a client adding up the chunks has content null beside calls, as OpenAI's."""
        return sse(self._chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant",
                                                                         content=None if tools else ""))]))

    def text_chunk(self, index: int, text: str, logprobs: list[TokenText] | None = None,
                   annotation: list[dict] | None = None) -> str:
        """A round's text, with its tokens' logprobs and origins when asked for (a round may carry tokens and no
        text yet: the detokenizer holds back an incomplete character or a possible stop string)."""
        if self.chat:
            choice = ChatChunkChoice(index=index, delta=Delta(content=text),
                                     logprobs=None if logprobs is None else chat_logprobs(logprobs))
        else:
            choice = CompletionChunkChoice(index=index, text=text, logprobs=self._completion_logprobs(index, logprobs))
        return sse(self._chunk([choice]), annotation)

    def tool_chunk(self, index: int, content: str, calls: list[CallDelta], logprobs: list[TokenText] | None = None,
                   annotation: list[dict] | None = None) -> str:
        """A round of a choice that may call tools: its new content and call deltas (tools/syntax.py's ToolStream),
        with its tokens' logprobs and origins when asked for."""
        delta = Delta(content=content if content or not calls else None, tool_calls=delta_tool_calls(calls))
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=None if logprobs is None else chat_logprobs(logprobs))
        return sse(self._chunk([choice]), annotation)

    def _completion_logprobs(self, index: int, logprobs: list[TokenText] | None) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        out = completion_logprobs(logprobs, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + sum(len(t.token) for t in logprobs)
        return out

    def finish_chunk(self, index: int, finish_reason: str, metrics: SpeculativeMetrics) -> str:
        """The last chunk of a choice: no text, its finish reason, and the speculation metrics of this choice."""
        if self.chat:
            choice = ChatChunkChoice(index=index, delta=Delta(), finish_reason=finish_reason)
        else:
            choice = CompletionChunkChoice(index=index, text="", finish_reason=finish_reason)
        return sse(self._chunk([choice], speculative_metrics=metrics))

    def usage_chunk(self, usage: Usage, metrics: SpeculativeMetrics) -> str:
        """After all choices, when the client asked for `stream_options.include_usage`: no choices, the usage."""
        return sse(self._chunk([], usage=usage, speculative_metrics=metrics))

    def response(self, texts: list[str], finish_reasons: list[str], usage: Usage, metrics: SpeculativeMetrics,
                 logprobs: list[list[TokenText]] | None = None,
                 messages: list[AssistantMessage] | None = None) -> ChatCompletion | Completion:
        """logprobs: per choice, its tokens' logprobs (None when the request did not ask); messages: per chat
        choice, its message when the text was read as tool calls (tool_message), else the text is the message."""
        per_choice = logprobs or [None] * len(texts)
        if self.chat:
            messages = messages or [AssistantMessage(content=text) for text in texts]
            choices = [ChatChoice(index=i, message=message, finish_reason=finish,
                                  logprobs=None if lps is None else chat_logprobs(lps))
                       for i, (message, finish, lps) in enumerate(zip(messages, finish_reasons, per_choice))]
            return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
                                  speculative_metrics=metrics)
        choices = [CompletionChoice(index=i, text=text, finish_reason=finish,
                                    logprobs=None if lps is None else completion_logprobs(lps, 0))
                   for i, (text, finish, lps) in enumerate(zip(texts, finish_reasons, per_choice))]
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
                          speculative_metrics=metrics)
