"""The one thread that runs the model: a step loop over the engine's shared batch (continuous batching).

The engine is not thread-safe (one target KV cache, drafters with caches of their own), so no handler touches
it: a handler puts a `Job` on a queue and reads the job's events from an `asyncio.Queue` that the worker fills
through `loop.call_soon_threadsafe`. Between two engine steps the worker

1. takes the jobs that arrived, in arrival order: encodes and checks their prompts and queues one engine
   sequence per choice (prompts x n), each with the job's speculation settings; the engine's scheduler admits
   them first come, first served, within its slot and token budgets (engine/scheduler.py);
2. aborts the sequences of jobs that were cancelled or whose client went away: their rows leave the batch
   before the next step;
3. runs one `engine.step()` and posts, for every sequence that committed tokens, the text of its round, and its
   end (finish reason and statistics) once it finished.

A step that raises fails only the jobs it touched (those holding a slot); jobs still waiting for one run
afterwards as if nothing happened. Bounds: at most `max_queued_requests` jobs wait for a slot (`submit` refuses
more with a 429), and a job's events stop at its deadline (`request_timeout`) with a 408 and its cancellation.

Every sequence has its own sampler state, generator and speculation settings, so what a request gets does not
depend on what else the server runs (see docs/server.md, "Concurrency").
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace

from ..config import SamplingParams, SpeculativeConfig
from ..engine import Sequence, SpeculativeEngine
from ..stats import GenerationStats
from .errors import APIError, invalid, queue_full, timed_out
from .metrics import ServerMetrics
from .constraints import constraint_param
from .responses import TokenText, annotate, decode_logprobs
from .runtime import Prompt, ServedModel

logger = logging.getLogger("verispec.server")


# -- events, worker thread -> event loop -----------------------------------------------------------------------------


@dataclass
class Started:
    """The request passed every check that needs the tokenizer; its choices are queued for the batch."""

    prompt_tokens: int  # all prompts of the request, each counted once
    speculative: bool  # a drafter was found for the request (a named drafter may also resolve to none)


@dataclass
class TextDelta:
    index: int  # choice
    text: str  # newly committed text (one engine round)
    logprobs: list[TokenText] | None = None  # of the round's tokens, when the request asked for logprobs
    annotation: list[dict] | None = None  # how each of the round's tokens was decided, when the request asked


@dataclass
class ChoiceDone:
    index: int
    finish_reason: str  # 'stop' | 'length'
    stats: GenerationStats


@dataclass
class JobDone:
    pass


@dataclass
class JobFailed:
    error: APIError


Event = Started | TextDelta | ChoiceDone | JobDone | JobFailed


class JobHandle:
    """The event loop's end of a job: its events, and a flag the worker checks between steps."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.deadline: float | None = None  # perf_counter time at which the job times out (set by `submit`)
        self.timeout: float | None = None  # the request timeout it came from, for the error message

    async def next(self) -> Event:
        """The job's next event; past its deadline, a 408 JobFailed (and the job is cancelled)."""
        if self.deadline is None:
            return await self.events.get()
        try:
            return await asyncio.wait_for(self.events.get(), self.deadline - time.perf_counter())
        except TimeoutError:
            self.cancel()
            return JobFailed(timed_out(self.timeout))

    def cancel(self) -> None:
        """Stop the job before the next step (or skip it, when it is still queued)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def put(self, event: Event) -> None:
        """Called on the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self._cancelled.set()


@dataclass
class Job:
    """One request: its prompts, times n choices each, all with one speculation setting."""

    prompts: list[Prompt]
    prompt_param: str  # the request field the prompts came from, named in errors ('messages' or 'prompt')
    params: SamplingParams  # max_new_tokens is replaced by `max_tokens` or the rest of the context; seed by seed + i
    max_tokens: int | None  # None: up to the end of the context
    n: int
    speculative: bool
    spec: SpeculativeConfig
    drafter_name: str | None
    handle: JobHandle
    annotate: bool = False  # the stream carries each token's origin (`speculative.annotate`)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None


# -- what the worker tracks per job ----------------------------------------------------------------------------------


@dataclass
class _Choice:
    index: int
    seq: Sequence
    admitted: bool = False  # it got a slot: its generation started (prompt tokens and generations count it)
    first_at: float | None = None  # when its first committed token was posted
    last_at: float | None = None
    tokens: int = 0


@dataclass
class _Active:
    """A job whose choices are in the engine (waiting, being prefilled or decoding)."""

    job: Job
    speculative: bool  # a drafter was found for it
    choices: dict[int, _Choice]  # seq_id -> choice still running
    admitted: bool = False  # one of its choices got a slot: the job counts as running, no longer queued

    @property
    def touched(self) -> bool:
        """A step has worked on one of its choices (it holds a slot, or has been prefilled or decoded)."""
        return any(_started(c.seq) for c in self.choices.values())


# -- the worker ------------------------------------------------------------------------------------------------------


class EngineWorker:
    """Steps every admitted request together on one thread; queued requests join between steps."""

    def __init__(self, served: ServedModel, metrics: ServerMetrics) -> None:
        self.served = served
        self.metrics = metrics
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._active: list[_Active] = []  # in arrival order
        self._by_seq: dict[int, tuple[_Active, _Choice]] = {}  # seq_id -> its job and choice
        self._lock = threading.Lock()  # guards `queued`: submit runs on the event loop, admission on this thread
        self.queued = 0  # jobs none of whose choices has a slot yet (submitted, not yet taken, or waiting)
        self._closing: APIError | None = None  # once set (shutdown), every job still there fails with it

    @property
    def engine(self) -> SpeculativeEngine:
        return self.served.engine

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_forever, name="verispec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every job (queued or running) and end the thread after its current step."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._count_queued(-1)
                job.handle.cancel()
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self, error: APIError) -> None:
        """Fail every job, running or queued, with `error` before the next step, and every job submitted later
        (graceful shutdown, once its deadline passed): streams end with it as their last chunk."""
        self._closing = error

    def queue_full(self) -> bool:
        return self.queued >= self.served.config.max_queued_requests

    def submit(self, job: Job) -> None:
        """Queue a job, or raise a 429 when `max_queued_requests` jobs already wait for a slot."""
        config = self.served.config
        with self._lock:
            if self.queue_full():
                raise queue_full(config.max_queued_requests)
            self.queued += 1
        self.metrics.queued.inc()
        if config.request_timeout is not None:
            job.handle.deadline = job.arrival + config.request_timeout
            job.handle.timeout = config.request_timeout
        self._jobs.put(job)

    def _count_queued(self, delta: int) -> None:
        with self._lock:
            self.queued += delta
        self.metrics.queued.inc(delta)

    # -- the loop --------------------------------------------------------------------------------------------------

    def _run_forever(self) -> None:
        while True:
            if not self._take_jobs(block=not self._active):
                for active in list(self._active):
                    active.job.handle.cancel()
                self._drop_cancelled()
                return
            if self._closing is not None:
                self._fail(list(self._active), self._closing)
            self._drop_cancelled()
            if self.engine.has_unfinished:
                try:
                    self._post(self.engine.step())
                except Exception as exc:  # noqa: BLE001 - a failed step fails the jobs it touched, never the worker
                    logger.exception("engine step failed")
                    self._fail([a for a in self._active if a.touched], _internal(exc))
            self._update_gauges()

    def _take_jobs(self, block: bool) -> bool:
        """Start the jobs that arrived (waiting for one when nothing runs). -> False once told to stop."""
        while True:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return True
            if job is None:
                return False
            self._start(job)
            block = False

    def _start(self, job: Job) -> None:
        """Check a job and queue its choices in the engine, or answer it with its error."""
        if job.handle.cancelled:
            self._count_queued(-1)
            return
        try:
            seqs, speculative = self._queue_choices(job)
        except APIError as error:
            self._count_queued(-1)
            job.handle.put(JobFailed(error))
            return
        except Exception as exc:  # noqa: BLE001 - one bad job must never take the worker down
            logger.exception("starting a generation failed")
            self._count_queued(-1)
            job.handle.put(JobFailed(_internal(exc)))
            return
        active = _Active(job, speculative, {seq.seq_id: _Choice(index, seq) for index, seq in enumerate(seqs)})
        self._active.append(active)
        for choice in active.choices.values():
            self._by_seq[choice.seq.seq_id] = (active, choice)

    def _queue_choices(self, job: Job) -> tuple[list[Sequence], bool]:
        served = self.served
        # Every check that needs the tokenizer happens before the first token, so a bad request streams nothing.
        prompts = [served.encode(prompt, job.prompt_param) for prompt in job.prompts]
        plans: list[tuple[list[int], SamplingParams]] = []
        for index in range(len(prompts) * job.n):
            ids = prompts[index // job.n]
            seed = None if job.params.seed is None else job.params.seed + index % job.n
            max_new_tokens = job.max_tokens or max(1, served.config.max_len - len(ids))
            try:
                params = replace(job.params, max_new_tokens=max_new_tokens, seed=seed)
            except ValueError as exc:
                raise invalid(str(exc), param="min_tokens") from exc
            served.check_request(len(ids), params, job.prompt_param)
            plans.append((ids, params))
        drafter = served.drafter(job.drafter_name) if job.speculative else None
        seqs: list[Sequence] = []
        try:
            for ids, params in plans:
                seqs.append(self.engine.add_request(ids, params, spec=job.spec, use_drafter=drafter is not None,
                                                    drafter=drafter))
        except BaseException as exc:
            for seq in seqs:
                self.engine.abort(seq)
            if isinstance(exc, ValueError):  # the request's grammar does not compile
                raise invalid(str(exc), param=constraint_param(job.params)) from exc
            raise
        job.handle.put(Started(sum(len(ids) for ids in prompts), drafter is not None))
        return seqs, drafter is not None

    def _drop_cancelled(self) -> None:
        """Abort the choices of cancelled jobs: their rows are gone before the next step."""
        for active in [a for a in self._active if a.job.handle.cancelled]:
            for choice in active.choices.values():
                self.engine.abort(choice.seq)
                if choice.admitted:  # a choice still queued never ran: no generation to count
                    self.metrics.observe_generation(choice.seq.stats, active.speculative, "cancelled")
            self._end(active)

    def _post(self, stepped: list[Sequence]) -> None:
        """Each stepped sequence's round: its text, and its end once it finished."""
        self._note_admissions()
        now = time.perf_counter()
        if stepped:  # else the step only prefilled
            report = self.engine.last_step
            self.metrics.observe_step(report.rows, report.speculative_ks)
        for seq in stepped:
            active, choice = self._by_seq[seq.seq_id]
            job = active.job
            token_ids, text = seq.take()
            self.metrics.observe_round(len(token_ids))
            if token_ids:
                if job.first_token_at is None:
                    job.first_token_at = now
                    self.metrics.time_to_first_token.observe(now - job.arrival)
                choice.first_at = choice.first_at or now
                choice.last_at = now
                choice.tokens += len(token_ids)
            logprobs = seq.take_logprobs()
            origins = seq.take_origins()
            if text or logprobs or (job.annotate and token_ids):
                tokens = None if logprobs is None else decode_logprobs(logprobs, self.served.tokenizer)
                annotation = annotate(token_ids, origins, self.served.tokenizer) if job.annotate else None
                job.handle.put(TextDelta(choice.index, text, tokens, annotation))
            if seq.finished:
                self.metrics.observe_generation(seq.stats, active.speculative, "ok")
                if choice.tokens > 1:
                    self.metrics.time_per_output_token.observe((choice.last_at - choice.first_at) / (choice.tokens - 1))
                job.handle.put(ChoiceDone(choice.index, seq.finish_reason, seq.stats))
                del active.choices[seq.seq_id]
                if not active.choices:
                    job.handle.put(JobDone())
                    self._end(active)

    def _fail(self, jobs: list[_Active], error: APIError) -> None:
        """These jobs get the error and their sequences leave the engine (after a failed step: rows it may have
        left half-updated)."""
        for active in jobs:
            for choice in active.choices.values():
                try:
                    self.engine.abort(choice.seq)
                except Exception:  # noqa: BLE001 - the step left the engine half-updated; drop what remains
                    logger.exception("aborting a sequence after a failed step")
                if choice.admitted:
                    self.metrics.observe_generation(choice.seq.stats, active.speculative, "error")
            active.job.handle.put(JobFailed(error))
            self._end(active)

    def _end(self, active: _Active) -> None:
        for seq_id in active.choices:
            self._by_seq.pop(seq_id, None)
        active.choices.clear()
        self._active.remove(active)
        if active.admitted:
            self.metrics.running.dec()
        else:
            self._count_queued(-1)

    def _note_admissions(self) -> None:
        """Choices that got a slot since the last look start their generation; their job runs, no longer queued."""
        for active in self._active:
            for choice in active.choices.values():
                seq = choice.seq
                if not choice.admitted and _started(seq):
                    choice.admitted = True
                    self.metrics.prompt_tokens.inc(seq.prompt_len)
                    if not active.admitted:
                        active.admitted = True
                        self._count_queued(-1)
                        self.metrics.running.inc()

    def _update_gauges(self) -> None:
        self._note_admissions()
        self.metrics.batch_rows.set(len(self.engine.running))
        self.metrics.waiting_sequences.set(len(self.engine.scheduler))


def _started(seq: Sequence) -> bool:
    """The engine has begun the sequence: it holds a slot, or was prefilled or decoded."""
    return seq.slot >= 0 or seq.prefilled > 0 or seq.stats.rounds > 0


def _internal(exc: Exception) -> APIError:
    return APIError(500, f"Generation failed ({type(exc).__name__}: {exc}).", type="server_error")
