"""`create_app`: the OpenAI-compatible FastAPI app around one `ServedModel`.

Handlers validate a request, turn it into a `Job` and read the job's events; the front end's threads prepare the
job (server/prepare.py) and all model work happens on the `EngineWorker` thread, never on the event loop.
Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics, and the
playground's GET / and GET /v1/speculation (playground.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..config import SamplingParams, SpeculativeConfig
from ..drafters.prediction import NAME as PREDICTION
from ..drafters.spec import NONE
from ..stats import GenerationStats
from .config import ServerConfig
from .errors import APIError, install_error_handlers, invalid, model_not_found
from .guard import install_guard
from .metrics import ServerMetrics
from .online import online_heads
from .playground import install_playground
from .protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    SpeculativeMetrics,
    SpeculativeOptions,
)
from .constraints import check_supported, constraint_field, logit_bias, requested_logprobs, structured_output
from .responses import DONE, ResponseBuilder, TokenText, finish_reason, speculative_metrics, sse, tool_message, usage
from .chat import chat_prompt
from .served import Prompt, ServedModel
from .jobs import ChoiceDone, Echo, Job, JobDone, JobFailed, JobHandle, Started, TextDelta
from .resume import FINISHED_LINE, PROGRESS_HEADER, RESUME_HEADER, parse_resume, progress_line
from .tools import ToolCalling, ToolStream, read
from .worker import EngineWorker

API_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/speculation", "/health", "/metrics")
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks whether its client is still there
CLIENT_GONE = 499  # nginx's "client closed request": the status metrics give requests whose client went away
_API_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}  # SamplingParams -> request field
_ERRORS = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}


class Server:
    """One app's state and the translation of a request into a job and of its events into a response."""

    def __init__(self, config: ServerConfig, served: ServedModel) -> None:
        self.config = config
        self.served = served
        self.metrics = ServerMetrics()
        self.worker = EngineWorker(served, self.metrics, online_heads(config, served, self.metrics))
        self.model_id = config.model_id
        self.model_names = {self.model_id, config.model}  # what a request's `model` may say
        self.created = int(time.time())

    # -- request -> job ------------------------------------------------------------------------------------------

    def key(self, request: Request) -> str:
        """A hash of the credentials the request sent: one per API key, one for every request that sent none. The
        hash keeps the key itself out of the drafters."""
        credentials = request.headers.get("authorization", "")
        return hashlib.sha256(credentials.encode()).hexdigest()[:32]

    def scope(self, request: Request) -> str | None:
        """The request's suffix-cache scope: its key (one scope per API key), or None (the one shared scope) with
        --suffix-shared-across-keys."""
        return None if self.config.suffix_shared_across_keys else self.key(request)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise model_not_found(name, hint=f"this server serves `{self.model_id}` (see GET /v1/models)")

    def sampling(self, body: SamplingFields, max_tokens: int | None, tools: ToolCalling | None = None) -> SamplingParams:
        check_supported(body)
        if max_tokens is not None and body.min_tokens > max_tokens:
            raise invalid(f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens}).",
                          param="min_tokens")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        try:
            return SamplingParams(
                max_new_tokens=max_tokens or max(1, body.min_tokens),  # the front end fills in the rest of the context
                min_new_tokens=body.min_tokens, temperature=body.temperature, top_k=max(0, body.top_k),
                top_p=body.top_p, min_p=body.min_p, repetition_penalty=body.repetition_penalty, seed=body.seed,
                stop=tuple(stop), stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                logit_bias=logit_bias(body, self.served.engine.target.vocab_size), logprobs=requested_logprobs(body),
                structured=structured_output(body, None if tools is None else tools.grammar()),
            )
        except ValueError as exc:
            field = str(exc).split()[0]
            raise invalid(str(exc), param=_API_NAMES.get(field, constraint_field(body, field))) from exc

    def speculation(self, option: SpeculativeOptions | bool | None,
                    params: SamplingParams) -> tuple[SpeculativeConfig, str | None]:
        """-> (speculation config, drafter name or None for the target alone).

        A request that fixes K (`draft_tokens`), and a seeded sampling request under rejection coupling, run with a
        fixed K unless they ask for adaptive K: adaptive K follows measured timings and earlier requests, and under
        rejection sampling a different K draws different random numbers, so the same seed would not give the same
        output twice. A coupled request (the default with a seed) does not depend on K: it keeps the server's
        adaptive setting.
        """
        if not isinstance(option, SpeculativeOptions):
            option = SpeculativeOptions(enabled=option)
        enabled = option.enabled
        if enabled is None:
            asked = option.draft_tokens is not None or option.draft_model is not None
            enabled = self.config.enable_speculative or asked
        adaptive = option.adaptive
        if adaptive is None:
            seeded_sampling = params.seed is not None and not params.greedy and not params.coupled
            adaptive = self.served.spec.adaptive and option.draft_tokens is None and not seeded_sampling
        changes = {"adaptive": adaptive}
        if option.draft_tokens is not None:
            changes["num_draft_tokens"] = option.draft_tokens
        if option.tree_nodes is not None:
            changes["tree_nodes"] = option.tree_nodes
        try:
            spec = replace(self.served.spec, **changes)
        except ValueError as exc:
            param = "speculative.tree_nodes" if "tree_nodes" in str(exc) else "speculative.draft_tokens"
            raise invalid(str(exc), param=param) from exc
        drafter = (option.draft_model or self.config.draft_model) if enabled else None
        return spec, None if drafter == NONE else drafter

    # -- job -> response -----------------------------------------------------------------------------------------

    async def handle(self, request: Request, body: SamplingFields, chat: bool, prompts: list[Prompt],
                     prompt_param: str, max_tokens: int | None, tools: ToolCalling | None = None,
                     echo: bool = False) -> Response:
        arrival = request.state.arrival = time.perf_counter()
        self.check_model(body.model)
        if len(prompts) * body.n > self.config.max_choices:
            raise invalid(f"{len(prompts)} prompts times n={body.n} is more than this server's limit of "
                          f"{self.config.max_choices} choices (--max-choices).", param="n")
        params = self.sampling(body, max_tokens, tools)
        if isinstance(body.speculative, SpeculativeOptions) and body.speculative.coupling is not None:
            params = replace(params, coupled=body.speculative.coupling == "gumbel")
        spec, drafter = self.speculation(body.speculative, params)
        predicted = prediction = predicted_text(body)
        if body.speculative is False or (isinstance(body.speculative, SpeculativeOptions)
                                         and body.speculative.enabled is False):
            prediction = None  # the target alone, as asked: nothing drafts (usage reports no prediction token)
        annotate = isinstance(body.speculative, SpeculativeOptions) and body.speculative.annotate
        if annotate and not body.stream:
            raise invalid("speculative.annotate adds a field to each streamed chunk: set stream to true.",
                          param="speculative.annotate")
        resume = parse_resume(request.headers.get(RESUME_HEADER))
        progress = PROGRESS_HEADER in request.headers and body.stream and len(prompts) * body.n == 1
        if resume is not None and not progress:
            raise invalid("Only a stream of one choice can be resumed.")
        if not self.worker.alive:
            raise APIError(503, "The model worker is not running; restart the server.", type="server_error")
        handle = JobHandle(asyncio.get_running_loop())
        self.worker.submit(Job(
            prompts=prompts, prompt_param=prompt_param, params=params, max_tokens=max_tokens, n=body.n,
            speculative=drafter is not None, spec=spec, drafter_name=drafter, handle=handle, annotate=annotate,
            arrival=arrival, scope=self.scope(request), key=self.key(request), tools=tools, progress=progress,
            resume=None if resume is None else resume.continuation, echo=echo, prediction=prediction,
        ))
        try:
            first = await self._next(handle, request)
        except BaseException:
            handle.cancel()
            raise
        if isinstance(first, JobFailed):
            raise first.error
        assert isinstance(first, Started), first
        drafter = drafter if first.speculative else None
        if prediction is not None:  # what speculative_metrics names as the drafter
            drafter = PREDICTION if drafter is None else f"{PREDICTION}+{drafter}"
        builder = ResponseBuilder(chat, self.model_id)
        if resume is not None:  # the same stream, picked up: its text offsets where it was left, its id and created
            builder.offsets[0] = first.logprob_chars
            if resume.id:
                builder.id, builder.created = resume.id, resume.created
        reply = _Reply(
            handle=handle, builder=builder, count=len(prompts) * body.n, prompt_tokens=first.prompt_tokens,
            drafter=drafter, spec=spec, logprobs=params.logprobs is not None, n=body.n, tools=tools,
            progress=progress, resumed=None if resume is None else first,
            role_sent=resume is not None and bool(resume.id), predicted=predicted is not None,
        )
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            outcome = _Outcome()

            def close() -> None:
                handle.cancel()
                self.metrics.count_request(request.url.path, outcome.status, time.perf_counter() - arrival)

            return _JobStream(self._stream(reply, include_usage, outcome), on_close=close)
        try:
            response = await self._collect(request, reply)
        finally:
            handle.cancel()  # a no-op once the job is done; stops it when this handler fails or is cancelled
        self.metrics.count_request(request.url.path, 200, time.perf_counter() - arrival)
        return JSONResponse(response.model_dump(mode="json"))

    async def _next(self, handle: JobHandle, request: Request):
        """The job's next event; gives up (and cancels the job) once the client has disconnected."""
        while True:
            try:
                return await asyncio.wait_for(handle.next(), timeout=DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    handle.cancel()
                    raise APIError(CLIENT_GONE, "The client closed the request.") from None

    async def _collect(self, request: Request, reply: _Reply) -> ChatCompletion | Completion:
        texts: list[list[str]] = [[] for _ in range(reply.count)]
        logprobs: list[list[TokenText]] = [[] for _ in range(reply.count)]
        finish_reasons = ["length"] * reply.count
        total = GenerationStats()
        cached = 0
        while True:
            event = await self._next(reply.handle, request)
            if isinstance(event, TextDelta | Echo):  # a choice's echo comes before its first text
                texts[event.index].append(event.text)
                logprobs[event.index] += event.logprobs or []
            elif isinstance(event, ChoiceDone):
                finish_reasons[event.index] = event.finish_reason
                total.merge(event.stats)
                cached += reply.cached_tokens(event)
            elif isinstance(event, JobFailed):
                raise event.error
            elif isinstance(event, JobDone):
                break
        joined = ["".join(t) for t in texts]
        messages = None
        if reply.tools is not None:  # the text read as content and calls, as a stream would have sent them
            outputs = [read(text, reply.tools.syntax, final=True) for text in joined]
            messages = [tool_message(out) for out in outputs]
            finish_reasons = [finish_reason(f, bool(out.calls)) for f, out in zip(finish_reasons, outputs)]
        return reply.builder.response(joined, finish_reasons,
                                      usage(reply.prompt_tokens, total.generated_tokens, cached, reply.prediction(total)),
                                      reply.metrics(total),
                                      logprobs if reply.logprobs else None, messages)

    async def _stream(self, reply: _Reply, include_usage: bool, outcome: _Outcome) -> AsyncIterator[str]:
        """SSE: role chunks (chat), a chunk per round that produced text, a finish chunk per choice, the usage
        chunk when asked for, `[DONE]`."""
        builder = reply.builder
        if builder.chat and not reply.role_sent:
            for index in range(reply.count):
                yield builder.role_chunk(index, tools=reply.tools is not None)
        total = GenerationStats()
        cached = 0
        # With tools, each choice's text goes through its ToolStream: content, and calls as they are written.
        streams = [ToolStream(reply.tools.syntax) for _ in range(reply.count)] if reply.tools is not None else None
        if streams is not None and reply.resumed is not None:
            streams[0].feed(reply.resumed.shown)  # where the earlier replica's stream was: sent already
        while True:
            event = await reply.handle.next()
            if isinstance(event, Echo):
                if reply.resumed is None:  # a resumed stream sent its echo from the earlier replica
                    yield builder.text_chunk(event.index, event.text, event.logprobs)
            elif isinstance(event, TextDelta):
                # A failover's report (server/resume.py), in front of the event or alone.
                report = progress_line(event.token_ids, event.shown) if reply.progress else ""
                if streams is None:
                    if event.text or event.logprobs or event.annotation is not None:
                        yield report + builder.text_chunk(event.index, event.text, event.logprobs, event.annotation)
                    else:  # tokens whose text is held back: the report alone
                        yield report + "\n"
                    continue
                content, calls = streams[event.index].feed(event.text)
                if content or calls or event.logprobs is not None or event.annotation is not None:
                    yield report + builder.tool_chunk(event.index, content, calls, event.logprobs, event.annotation)
                elif report:
                    yield report + "\n"
            elif isinstance(event, ChoiceDone):
                total.merge(event.stats)
                cached += reply.cached_tokens(event)
                finish = event.finish_reason
                end = ""  # the choice's last events
                if streams is not None:
                    stream = streams[event.index]
                    content, calls = stream.finish()
                    if content or calls:
                        end = builder.tool_chunk(event.index, content, calls)
                    finish = finish_reason(finish, bool(stream.ids))
                end += builder.finish_chunk(event.index, finish, reply.metrics(event.stats))
                if reply.progress:  # one choice: its end, the usage and [DONE] in one piece, which a failover
                    outcome.status = 200  # never splits (server/resume.py)
                    if include_usage:
                        end += builder.usage_chunk(usage(reply.prompt_tokens, total.generated_tokens +
                                                         reply.resumed_tokens, cached, reply.prediction(total)),
                                                   reply.metrics(total))
                    yield FINISHED_LINE + end + DONE
                    return
                yield end
            elif isinstance(event, JobFailed):
                outcome.status = event.error.status
                yield sse(event.error.body())
                break
            elif isinstance(event, JobDone):
                outcome.status = 200
                if include_usage:
                    yield builder.usage_chunk(usage(reply.prompt_tokens, total.generated_tokens + reply.resumed_tokens,
                                                    cached, reply.prediction(total)), reply.metrics(total))
                break
        yield DONE

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_id, created=self.created, max_model_len=self.config.max_len)


@dataclass
class _Reply:
    """What turning one job's events into a response needs."""

    handle: JobHandle
    builder: ResponseBuilder
    count: int  # choices: prompts times n
    prompt_tokens: int
    drafter: str | None  # None: the target alone
    spec: SpeculativeConfig
    logprobs: bool  # the request asked for logprobs
    n: int = 1  # choices per prompt
    tools: ToolCalling | None = None  # the answer may be tool calls: its text is read by the format's syntax
    progress: bool = False  # the stream reports its tokens for a failover (server/resume.py)
    resumed: Started | None = None  # a stream picked up from an earlier replica: what it had shown
    role_sent: bool = False  # ... and its chat role chunk was sent there
    predicted: bool = False  # the request has a prediction: usage reports its tokens

    def prediction(self, total: GenerationStats) -> GenerationStats | None:
        """What usage reads the prediction's tokens from (None without a prediction)."""
        return total if self.predicted else None

    @property
    def resumed_tokens(self) -> int:
        """Tokens the earlier replica streamed: usage counts them as this request's."""
        return 0 if self.resumed is None else self.resumed.resumed

    def cached_tokens(self, done: ChoiceDone) -> int:
        """A finished choice's share of usage's cached_tokens: each prompt counts once, by its first choice (the
        others copy that choice's prefix, within this request, which OpenAI's figure does not count)."""
        return done.stats.cached_tokens if done.stats is not None and done.index % self.n == 0 else 0

    def metrics(self, stats: GenerationStats) -> SpeculativeMetrics:
        return speculative_metrics(stats, self.drafter, self.spec)


class _Outcome:
    status = CLIENT_GONE  # until the stream's last event says otherwise


class _JobStream(StreamingResponse):
    """A job's event stream. However it ends (last event, client disconnect, shutdown, or before it began),
    `on_close` runs: its row leaves the batch before the next step, and the request is counted."""

    def __init__(self, events: AsyncIterator[str], on_close) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def predicted_text(body: SamplingFields) -> str | None:
    """The request's prediction as text (a chat request's text parts joined); None without one (or an empty one,
    which predicts nothing)."""
    prediction = getattr(body, "prediction", None)
    if prediction is None:
        return None
    text = prediction if isinstance(prediction, str) else prediction.text()
    return text or None


def _completion_prompts(body: CompletionRequest) -> list[Prompt]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt must not be empty.", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def create_app(config: ServerConfig | None = None, served: ServedModel | None = None) -> FastAPI:
    """The app for `config` (loading its models), or around an already loaded `served` model."""
    config = config or ServerConfig()
    server = Server(config, served or ServedModel.load(config))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.worker.start()
        try:
            yield
        finally:
            server.worker.stop()

    app = FastAPI(title="verispec", summary="OpenAI-compatible server with speculative decoding", lifespan=lifespan)
    app.state.server = server

    def count_error(request: Request, status: int) -> None:
        path = request.url.path
        arrival = getattr(request.state, "arrival", None)
        server.metrics.count_request(path if path in API_ENDPOINTS else "other", status,
                                     None if arrival is None else time.perf_counter() - arrival)

    install_error_handlers(app, on_error=count_error)
    app.state.gate = install_guard(app, config, on_reject=count_error, queue_full=server.worker.queue_full)

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        max_tokens = body.max_completion_tokens or body.max_tokens
        prompt, tools = chat_prompt(body, server.served)
        return await server.handle(request, body, True, [prompt], "messages", max_tokens, tools)

    @app.post("/v1/completions", response_model=Completion, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if body.max_tokens == 0 and not body.echo:
            raise invalid("max_tokens must be at least 1; 0 is for echo (the prompt and its logprobs, nothing "
                          "generated).", param="max_tokens")
        return await server.handle(request, body, False, _completion_prompts(body), "prompt", body.max_tokens,
                                   echo=body.echo)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        server.metrics.count_request("/v1/models", 200)
        return ModelList(data=[server.model_card()])

    @app.get("/v1/models/{name:path}", response_model=ModelCard, responses=_ERRORS)
    async def retrieve_model(name: str) -> ModelCard:
        server.check_model(name)
        server.metrics.count_request("/v1/models", 200)
        return server.model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        if not server.worker.alive:
            raise APIError(503, "The model worker is not running.", type="server_error")
        return JSONResponse({"status": "ok", "model": server.model_id})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    install_playground(app, server)

    return app
