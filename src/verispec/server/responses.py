"""Response bodies and server-sent-event chunks in OpenAI's formats, for chat and for text completions."""

from __future__ import annotations

import json
import time
import uuid

from ..config import SpeculativeConfig
from ..stats import GenerationStats
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    Delta,
    SpeculativeMetrics,
    Usage,
)

DONE = "data: [DONE]\n\n"


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
    )


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def sse(chunk: ChatCompletionChunk | CompletionChunk | dict) -> str:
    """One event. Chunks leave out `usage` and `speculative_metrics` when empty, and deltas their unset keys,
    as OpenAI's stream does; `finish_reason` and `logprobs` stay, as null."""
    if isinstance(chunk, dict):
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
    body = chunk.model_dump(mode="json")
    for key in ("usage", "speculative_metrics"):
        if body[key] is None:
            del body[key]
    for choice in body["choices"]:
        if "delta" in choice:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


class ResponseBuilder:
    """Builds one request's bodies: the full response, or its stream of chunks (same id and `created`)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _chunk(self, choices: list, **extra) -> ChatCompletionChunk | CompletionChunk:
        cls = ChatCompletionChunk if self.chat else CompletionChunk
        return cls(id=self.id, created=self.created, model=self.model, choices=choices, **extra)

    def role_chunk(self, index: int) -> str:
        """The first chunk of a chat choice: the role and empty content (chat only)."""
        return sse(self._chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))]))

    def text_chunk(self, index: int, text: str) -> str:
        if self.chat:
            choice = ChatChunkChoice(index=index, delta=Delta(content=text))
        else:
            choice = CompletionChunkChoice(index=index, text=text)
        return sse(self._chunk([choice]))

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

    def response(self, texts: list[str], finish_reasons: list[str], usage: Usage,
                 metrics: SpeculativeMetrics) -> ChatCompletion | Completion:
        if self.chat:
            choices = [ChatChoice(index=i, message=AssistantMessage(content=text), finish_reason=finish)
                       for i, (text, finish) in enumerate(zip(texts, finish_reasons))]
            return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
                                  speculative_metrics=metrics)
        choices = [CompletionChoice(index=i, text=text, finish_reason=finish)
                   for i, (text, finish) in enumerate(zip(texts, finish_reasons))]
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
                          speculative_metrics=metrics)
