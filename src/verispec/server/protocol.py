"""Request and response bodies of the OpenAI-compatible API (pydantic), plus verispec's `speculative` extension.

Requests ignore unknown fields (OpenAI clients send many we have no use for) but check the types of the fields
they use strictly, as OpenAI does: `"max_tokens": "16"` is a 400, not a silent conversion. Responses carry the
OpenAI fields and, in addition, `speculative_metrics`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..config import MAX_LOGPROBS

MAX_CHOICES = 64  # most choices (n, times the prompts of a completion request) one request may ask for
MAX_STOP_STRINGS = 16  # stop strings, and separately stop_token_ids, one request may give
MAX_STOP_CHARS = 256  # longest stop string: the stop check searches a window this long at every token
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # JSON parsing accepts NaN


class SpeculativeOptions(_Request):
    """Per-request speculation (`"speculative": {...}`; `true`/`false` is short for `{"enabled": ...}`)."""

    enabled: bool | None = None
    """Draft and verify (true) or decode with the target alone (false); default: the server's setting, or true
    when draft_tokens or draft_model is given."""
    draft_tokens: int | None = None
    """K, draft tokens per round (1..64), fixed for this request; default: the server's --draft-tokens."""
    adaptive: bool | None = None
    """Choose K per round (up to the server's --max-speculation-depth); default: the server's setting, except
    that a request with draft_tokens, or a seeded sampling request under "rejection" coupling, runs with a fixed K."""
    draft_model: str | None = None
    """Another drafter: a model folder / .gguf / hub id / name, or 'none'; loaded on first use and cached."""
    tree_nodes: int | None = None
    """Token trees (0..64 draft tokens per round) for drafters that propose them, e.g. a draft head; 0: chains;
    default: the server's --tree-nodes."""
    coupling: Literal["rejection", "gumbel"] | None = None
    """How a sampled request's randomness meets the drafts: "rejection" (rejection sampling, the highest
    acceptance; a seed repeats its output only with the same K) or "gumbel" (coupled: the noise of each output
    position is keyed by the seed, so a seed gives the target alone's tokens whatever the drafter, K or batch);
    default: "gumbel" for a request with a seed, "rejection" without."""
    annotate: bool = False
    """Streaming only: each chunk also carries `verispec.tokens`, how each of its tokens was decided (accepted
    draft token and its drafter stage, recovered, bonus, or the target's own) and in which round."""


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: "text" (no constraint), "json_object", or "json_schema" with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# OpenAI fields verispec does not implement: a request that sets one gets a 400 naming it, never silence.
UNSUPPORTED_FIELDS = ("functions", "function_call", "audio", "modalities", "web_search_options",
                      "reasoning_effort", "suffix", "best_of", "service_tier", "store", "metadata")
# Tool calling is chat's (server/tools/); a text completion that asks for it gets the same 400.
CHAT_ONLY_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
# Echo is text completions' (server/echo.py); a chat request that asks for it gets the same 400.
COMPLETION_ONLY_FIELDS = ("echo",)


class SamplingFields(_Request):
    """Fields shared by chat and completion requests."""

    model: str | None = None
    """The served model's id (GET /v1/models) or the target given to `verispec serve`; default: that model."""
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1, le=2**31 - 1)  # -1 or 0: off (vLLM uses -1)
    min_p: float = Field(default=0.0, ge=0, lt=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI; choice i uses seed + i
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    speculative: SpeculativeOptions | bool | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (as a string, as OpenAI's) -> bias in [-100, 100], added to that token's logit."""
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    """vLLM's extension: a JSON schema the output follows (as response_format json_schema)."""
    guided_regex: str | None = None
    """vLLM's extension: a regular expression the output matches."""
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    """vLLM's extension: the output is exactly one of these strings."""
    guided_grammar: str | None = None
    """vLLM's extension: a Lark grammar the output follows."""
    # Unsupported OpenAI fields, declared so that setting one is a clear 400 (see UNSUPPORTED_FIELDS).
    functions: object | None = None
    function_call: object | None = None
    audio: object | None = None
    modalities: object | None = None
    web_search_options: object | None = None
    reasoning_effort: object | None = None
    suffix: object | None = None
    best_of: object | None = None
    service_tier: object | None = None
    store: object | None = None
    metadata: object | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class RefusalPart(_Request):
    """An assistant message's refusal, as OpenAI's content parts carry it (read as text)."""

    type: Literal["refusal"]
    refusal: str


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI's responses give it


class ToolCallIn(_Request):
    """A call an assistant message of the history made (as a response's `message.tool_calls` carried it)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | RefusalPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, TextPart) else part.refusal for part in self.content)


class Prediction(_Request):
    """OpenAI's predicted output: text the answer is expected to repeat (a file being edited), drafted from and
    verified like any draft (drafters/prediction.py): the answer is the target's all the same."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[object] | None = None
    """Function definitions ({"type": "function", "function": {name, description, parameters}}), checked by
    server/tools/spec.py (so that each fault is a 400 naming its field)."""
    tool_choice: object | None = None
    """"auto" (default with tools), "none", "required", or {"type": "function", "function": {"name": ...}}."""
    parallel_tool_calls: bool | None = None
    """Several calls in one answer (default true)."""
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: object | None = None  # text completions only (COMPLETION_ONLY_FIELDS): declared for a clear 400
    prediction: Prediction | None = None
    """The answer's expected text ({"type": "content", "content": text or text parts})."""


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    tools: object | None = None  # chat only (CHAT_ONLY_FIELDS): declared so that setting one is a clear 400
    tool_choice: object | None = None
    parallel_tool_calls: object | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions; 0 only with echo
    echo: bool = False
    """The prompt in front of the completion; with logprobs, its tokens' logprobs too (the first one null)."""
    prediction: str | Prediction | None = None
    """The completion's expected text (verispec's extension of OpenAI's chat field; the chat form is taken too)."""


# -- responses -------------------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (OpenAI's field)


class CompletionTokensDetails(BaseModel):
    """OpenAI's predicted-output figures: the prediction's draft tokens the target accepted and those it did not
    (rejected, or after a rejection in their round); their sum is the prediction tokens proposed."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # with a prediction only


class SpeculativeMetrics(BaseModel):
    """What speculation did for this response (all choices together); vocabulary as in DEVELOPERS.md."""

    enabled: bool
    draft_model: str | None
    adaptive: bool  # K chosen per round (then num_draft_tokens is None)
    num_draft_tokens: int | None  # the fixed K (None when speculation was off or adaptive)
    acceptance_mode: str  # 'exact' (lossless) or e.g. 'top_k:5' (LOSSY)
    lossy: bool  # True when a lossy acceptance mode changed the output distribution
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    acceptance_by_position: list[float]
    draft_ms: float
    verify_ms: float
    fallbacks: int
    rounds_by_stage: dict[str, int] = {}  # drafter (a cascade's stage) -> rounds it drafted


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat logprobs: one entry per generated token (`content`)."""

    content: list[TokenLogprobEntry] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one item per token (with echo, the prompt's first: its first
    token has no logprob and no alternatives, null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text (valid against the function's schema when the call is complete)


class ToolCall(BaseModel):
    id: str  # call_...
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None only beside tool_calls, when no text came before them
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda value: value is None)


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    speculative_metrics: SpeculativeMetrics


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage
    speculative_metrics: SpeculativeMetrics


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first chunk only
    arguments: str | None = None  # the next piece of the arguments' JSON text


class DeltaToolCall(BaseModel):
    index: int  # the call's position in message.tool_calls
    id: str | None = None  # in a call's first chunk only, with type and name
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculative_metrics: SpeculativeMetrics | None = None


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    speculative_metrics: SpeculativeMetrics | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "verispec"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
