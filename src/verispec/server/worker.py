"""The one thread that runs the model, and the jobs the HTTP handlers hand it.

The engine is not thread-safe (one target KV cache, drafters with caches of their own), so no handler touches
it: a handler puts a `Job` on a FIFO queue and reads the job's events from an `asyncio.Queue` that the worker
fills through `loop.call_soon_threadsafe`. Jobs run one at a time, first come first served, each generation
exactly as it would run alone, so a request's output does not depend on what else the server is doing.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace

from ..config import SamplingParams, SpeculativeConfig
from ..drafters.base import Drafter
from ..stats import GenerationStats
from .errors import APIError, invalid
from .metrics import ServerMetrics
from .runtime import Prompt, ServedModel

logger = logging.getLogger("verispec.server")


# -- events, worker thread -> event loop -----------------------------------------------------------------------------


@dataclass
class Started:
    """The request passed every check that needs the tokenizer; generation begins."""

    prompt_tokens: int  # all prompts of the request, each counted once
    speculative: bool  # a drafter was found for the request (a named drafter may also resolve to none)


@dataclass
class TextDelta:
    index: int  # choice
    text: str  # newly committed text (one engine round)


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
    """The event loop's end of a job: its events, and a flag the worker checks between rounds."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop the job at its next round (or skip it, when it is still queued)."""
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
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None


# -- the worker ------------------------------------------------------------------------------------------------------


class EngineWorker:
    """Runs every job on one thread, in arrival order.

    This is where a scheduler goes once the runner verifies batches: instead of running one job to completion,
    `_run_forever` would admit several jobs and step them together, one batched verification pass per round
    (ragged acceptance per sequence), while each job keeps its own sampler and seed.
    """

    def __init__(self, served: ServedModel, metrics: ServerMetrics) -> None:
        self.served = served
        self.metrics = metrics
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._current: Job | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_forever, name="verispec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the running job, drop the queued ones, and end the thread."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self.metrics.queued.dec()
                job.handle.cancel()
        current = self._current
        if current is not None:
            current.handle.cancel()
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        self.metrics.queued.inc()
        self._jobs.put(job)

    def _run_forever(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self.metrics.queued.dec()
            if job.handle.cancelled:
                continue
            self._current = job
            self.metrics.running.inc()
            try:
                self._run(job)
            except APIError as error:
                job.handle.put(JobFailed(error))
            except Exception as exc:  # noqa: BLE001 - one failed job must never take the worker down
                logger.exception("generation failed")
                job.handle.put(JobFailed(APIError(500, f"Generation failed ({type(exc).__name__}: {exc}).",
                                                  type="server_error")))
            finally:
                self.metrics.running.dec()
                self._current = None

    def _run(self, job: Job) -> None:
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
        job.handle.put(Started(sum(len(ids) for ids in prompts), drafter is not None))
        for index, (ids, params) in enumerate(plans):
            if not self._generate(job, index, ids, params, drafter):
                return
        job.handle.put(JobDone())

    def _generate(self, job: Job, index: int, ids: list[int], params: SamplingParams, drafter: Drafter | None) -> bool:
        """Run one choice, posting its text round by round. -> False when the client went away."""
        speculative = drafter is not None
        chunks = self.served.engine.generate_iter(ids, params, spec=job.spec, use_drafter=speculative,
                                                  drafter=drafter)
        self.metrics.prompt_tokens.inc(len(ids))
        first = last = None
        num_tokens = 0
        finish = "length"
        outcome = "error"
        started = False
        stats: GenerationStats | None = None
        try:
            while True:
                if job.handle.cancelled:  # checked before each round, so a cancelled job runs no further round
                    outcome = "cancelled"
                    return False
                started = True
                chunk = next(chunks, None)
                if chunk is None:
                    break
                now = time.perf_counter()
                self.metrics.observe_round(len(chunk.token_ids))
                if chunk.token_ids:
                    if job.first_token_at is None:
                        job.first_token_at = now
                        self.metrics.time_to_first_token.observe(now - job.arrival)
                    first = first or now
                    last = now
                    num_tokens += len(chunk.token_ids)
                finish = chunk.finish_reason or finish
                if chunk.text:
                    job.handle.put(TextDelta(index, chunk.text))
                stats = chunk.stats or stats
            outcome = "ok"
        finally:
            chunks.close()  # a cancelled generation stops here, between two rounds
            if outcome != "ok":  # the engine still finalised what the closed generation did
                stats = self.served.engine.last_stats if started else None
            self.metrics.observe_generation(stats, speculative, outcome)
        if num_tokens > 1:
            self.metrics.time_per_output_token.observe((last - first) / (num_tokens - 1))
        job.handle.put(ChoiceDone(index, finish, stats))
        return True
