"""The one thread that runs the model: a step loop over the engine's shared batch (continuous batching).

The engine is not thread-safe (one target KV cache, drafters with caches of their own), so no handler touches
it: a handler submits a `Job` (server/jobs.py) and reads the job's events from an `asyncio.Queue` that the
worker fills through `loop.call_soon_threadsafe`. A submitted job is first prepared on the front end's threads
(server/prepare.py: prompts tokenized and checked, grammars compiled), off this thread; a job that fails there
gets its error from the front end and never reaches the engine. Between two engine steps the worker

1. takes the jobs that are prepared, in the order they became ready: scores the prompts of a job with `echo` and
   logprobs (one forward each on a runner of their own, server/echo.py), resolves their drafter and queues one
   engine sequence per choice (prompts x n), each with the job's speculation settings; the engine's scheduler
   admits them first come, first served, within its slot and token budgets (engine/scheduler.py);
2. aborts the sequences of jobs that were cancelled or whose client went away: their rows leave the batch
   before the next step;
3. runs one `engine.step()` and posts, for every sequence that committed tokens, the text of its round, and its
   end (finish reason and statistics) once it finished.

A step that raises fails only the jobs it touched (those holding a slot); jobs still waiting for one run
afterwards as if nothing happened. Bounds: at most `max_queued_requests` jobs wait for a slot, being prepared or
prepared (`submit` refuses more with a 429), and a job's events stop at its deadline (`request_timeout`) with a
408 and its cancellation.

Every sequence has its own sampler state, generator and speculation settings, so what a request gets does not
depend on what else the server runs (see docs/server.md, "Concurrency").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from ..engine import Sequence, SpeculativeEngine
from ..runtime.threads import governor
from ..stats import GenerationStats
from .echo import echo_text, echo_tokens
from .errors import APIError, invalid, queue_full
from .jobs import ChoiceDone, Echo, Job, JobDone, JobFailed, JobHandle, Started, TextDelta
from .metrics import ServerMetrics
from .online import OnlineHeads
from .prepare import FrontEnd, PreparedJob, internal_error
from .responses import annotate, decode_logprobs
from .served import ServedModel
from .tools.markers import MarkedText

# The job's types are re-exported: the worker's callers may keep importing them from here.
__all__ = ["ChoiceDone", "EngineWorker", "Job", "JobDone", "JobFailed", "JobHandle", "Started", "TextDelta"]

logger = logging.getLogger("verispec.server")


# -- what the worker tracks per job ----------------------------------------------------------------------------------


@dataclass
class _Choice:
    index: int
    seq: Sequence
    admitted: bool = False  # it got a slot: its generation started (prompt tokens and generations count it)
    first_at: float | None = None  # when its first committed token was posted
    last_at: float | None = None
    tokens: int = 0
    marks: MarkedText | None = None  # puts the tool-call markers that are special tokens back into its text


@dataclass
class _Active:
    """A job whose choices are in the engine (waiting, being prefilled or decoding)."""

    job: Job
    speculative: bool  # a drafter was found for it
    choices: dict[int, _Choice]  # seq_id -> choice still running
    admitted: bool = False  # one of its choices got a slot: the job counts as running, no longer queued

    @property
    def touched(self) -> bool:
        """A step has worked on one of its running choices (the engine's step reports said it started)."""
        return any(c.admitted for c in self.choices.values())


# -- the worker ------------------------------------------------------------------------------------------------------


class EngineWorker:
    """Steps every admitted request together on one thread; queued requests join between steps."""

    def __init__(self, served: ServedModel, metrics: ServerMetrics, online: OnlineHeads | None = None) -> None:
        self.served = served
        self.metrics = metrics
        self._jobs: queue.Queue[PreparedJob | None] = queue.Queue()  # prepared, for the engine thread to take
        self._front = FrontEnd(served, ready=self._jobs.put, dropped=self._drop_unprepared)
        self._thread: threading.Thread | None = None
        self._active: list[_Active] = []  # in arrival order
        self._by_seq: dict[int, tuple[_Active, _Choice]] = {}  # seq_id -> its job and choice
        self._lock = threading.Lock()  # guards `queued`: submit runs on the event loop, admission on this thread
        self.queued = 0  # jobs none of whose choices has a slot yet (being prepared, prepared, or waiting)
        self._closing: APIError | None = None  # once set (shutdown), every job still there fails with it
        self.online = online  # --online-train: each API key's own head and its trainer (server/online.py)

    @property
    def engine(self) -> SpeculativeEngine:
        return self.served.engine

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_forever, name="verispec-engine", daemon=True)
        self._thread.start()
        if self.online is not None:
            self.online.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every job (being prepared, queued or running) and end the thread after its current step."""
        self._front.shutdown()
        while True:
            try:
                prepared = self._jobs.get_nowait()
            except queue.Empty:
                break
            if prepared is not None:
                self._count_queued(-1)
                prepared.job.handle.cancel()
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
        if self.online is not None:
            self.online.stop(timeout)

    def close(self, error: APIError) -> None:
        """Fail every job, running or queued, with `error` before the next step, and every job submitted later
        (graceful shutdown, once its deadline passed): streams end with it as their last chunk."""
        self._closing = error

    def queue_full(self) -> bool:
        return self.queued >= self.served.config.max_queued_requests

    def submit(self, job: Job) -> None:
        """Queue a job for preparation, or raise a 429 when `max_queued_requests` jobs already wait for a slot."""
        config = self.served.config
        with self._lock:
            if self.queue_full():
                raise queue_full(config.max_queued_requests)
            self.queued += 1
        self.metrics.queued.inc()
        if config.request_timeout is not None:
            job.handle.deadline = job.arrival + config.request_timeout
            job.handle.timeout = config.request_timeout
        self._front.submit(job)

    def _drop_unprepared(self, job: Job, error: APIError | None) -> None:
        """On a front-end thread: a job that ends before the engine (its error, or its client left)."""
        self._count_queued(-1)
        if error is not None:
            job.handle.put(JobFailed(error))

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
            if self.online is not None:
                self.online.swap()  # between steps: no step ever runs on half-swapped weights
            if self.engine.has_unfinished:
                try:
                    stepped = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - a failed step fails the jobs it touched, never the worker
                    logger.exception("engine step failed")
                    self._note_started(self.engine.last_step.started)
                    self._fail([a for a in self._active if a.touched], internal_error(exc))
                else:
                    self._note_started(self.engine.last_step.started)
                    self._post(stepped)
            self._update_gauges()

    def _take_jobs(self, block: bool) -> bool:
        """Start the jobs that are prepared (waiting for one when nothing runs). -> False once told to stop."""
        while True:
            try:
                prepared = self._jobs.get(block=block)
            except queue.Empty:
                return True
            if prepared is None:
                return False
            self._start(prepared)
            block = False

    def _start(self, prepared: PreparedJob) -> None:
        """Queue a prepared job's choices in the engine, or answer it with its error."""
        job = prepared.job
        if job.handle.cancelled:  # its client left after it was prepared: it never reaches the engine
            self._count_queued(-1)
            return
        try:
            echoes = self._echoes(prepared) if job.echo else []
            if job.max_tokens == 0:  # the echo is the whole answer
                self._answer_echo(prepared, echoes)
                return
            choices, speculative = self._queue_choices(prepared)
        except APIError as error:
            self._count_queued(-1)
            job.handle.put(JobFailed(error))
            return
        except Exception as exc:  # noqa: BLE001 - one bad job must never take the worker down
            logger.exception("starting a generation failed")
            self._count_queued(-1)
            job.handle.put(JobFailed(internal_error(exc)))
            return
        for echo in echoes:  # after Started, before the choices' first text
            job.handle.put(echo)
        active = _Active(job, speculative, {choice.seq.seq_id: choice for choice in choices})
        self._active.append(active)
        for choice in active.choices.values():
            self._by_seq[choice.seq.seq_id] = (active, choice)
        for choice in [c for c in active.choices.values() if c.seq.finished]:  # resumed after its last token
            token_ids, text = choice.seq.take()  # what the finish lets out of the text held back, if not shown yet
            text = text if choice.marks is None else choice.marks.feed(token_ids, text)
            if text:
                job.handle.put(TextDelta(choice.index, text, shown=choice.seq.stopper.emitted))
            job.handle.put(ChoiceDone(choice.index, choice.seq.finish_reason, choice.seq.stats))
            del active.choices[choice.seq.seq_id]
            self._by_seq.pop(choice.seq.seq_id)
            if not active.choices:
                job.handle.put(JobDone())
                self._end(active)

    def _queue_choices(self, prepared: PreparedJob) -> tuple[list[_Choice], bool]:
        """Resolve the job's drafter (a 400, 404 or 503 when it cannot be used) and add its prepared sequences."""
        job = prepared.job
        drafter = self.served.drafter(job.drafter_name) if job.speculative else None
        if self.online is not None and drafter is not None and drafter is self.online.base:
            drafter = self.online.drafter_for(job.key)  # the request's API key's own head, never another key's
        seqs: list[Sequence] = []
        try:
            for choice in prepared.choices:
                seqs.append(self.engine.add_request(choice.prompt_ids, choice.params, spec=job.spec,
                                                    use_drafter=drafter is not None, drafter=drafter,
                                                    grammar=choice.grammar, scope=job.scope, resume=choice.resume,
                                                    prediction=choice.prediction))
        except BaseException as exc:
            for seq in seqs:
                self.engine.abort(seq)
            if job.resume is not None and isinstance(exc, ValueError):  # output this request cannot have made
                raise invalid(f"The stream cannot be resumed: {exc}.") from exc
            raise
        special = job.tools.format.special_tokens if job.tools is not None else None
        choices = [_Choice(index, seq, marks=MarkedText(self.served.tokenizer, special) if special else None)
                   for index, seq in enumerate(seqs)]
        speculative = drafter is not None or job.prediction is not None  # a prediction drafts on its own too
        started = Started(prepared.prompt_tokens, speculative)
        if job.resume is not None:
            choice, tokenizer = choices[0], self.served.tokenizer
            started.resumed = len(job.resume.token_ids)
            started.shown = choice.seq.stopper.text[: choice.seq.stopper.emitted]
            if choice.marks is not None:
                started.shown = choice.marks.feed(job.resume.token_ids, started.shown)
            started.logprob_chars = sum(len(tokenizer.decode([t])) for t in job.resume.token_ids)
        job.handle.put(started)
        return choices, speculative

    def _echoes(self, prepared: PreparedJob) -> list[Echo]:
        """Each choice's prompt to echo, with its tokens' logprobs when the request asks for logprobs: one target
        forward over each prompt (its choices share it), run here between two steps (server/echo.py)."""
        job = prepared.job
        top = job.params.logprobs
        per_prompt: dict[int, tuple[str, list | None]] = {}
        echoes = []
        for index, choice in enumerate(prepared.choices):
            p = index // job.n
            if p not in per_prompt:
                tokens = None if top is None else echo_tokens(self.served, choice.prompt_ids, top)
                per_prompt[p] = (echo_text(self.served, job.prompts[p], choice.prompt_ids), tokens)
            echoes.append(Echo(index, *per_prompt[p]))
        return echoes

    def _answer_echo(self, prepared: PreparedJob, echoes: list[Echo]) -> None:
        """A job with max_tokens 0: its echoes are its answer (finish reason length, no token generated); it never
        reaches the engine."""
        job = prepared.job
        self._count_queued(-1)
        job.handle.put(Started(prepared.prompt_tokens, False))
        for echo in echoes:
            job.handle.put(echo)
            job.handle.put(ChoiceDone(echo.index, "length", GenerationStats()))
        job.handle.put(JobDone())

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
        now = time.perf_counter()
        report = self.engine.last_step
        self.metrics.prefix_cache_queries.inc(report.prefix_queried_tokens)
        self.metrics.prefix_cache_hits.inc(report.prefix_hit_tokens)
        if stepped:  # else the step only prefilled
            self.metrics.observe_step(report.rows, report.speculative_ks, governor().threads)
        for seq in stepped:
            active, choice = self._by_seq[seq.seq_id]
            job = active.job
            token_ids, text = seq.take()
            if choice.marks is not None:
                text = choice.marks.feed(token_ids, text)
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
            if text or logprobs or ((job.annotate or job.progress) and token_ids):
                tokens = None if logprobs is None else decode_logprobs(logprobs, self.served.tokenizer)
                annotation = annotate(token_ids, origins, self.served.tokenizer) if job.annotate else None
                job.handle.put(TextDelta(choice.index, text, tokens, annotation, token_ids, seq.stopper.emitted))
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

    def _note_started(self, started: list[Sequence]) -> None:
        """The sequences the step started (the engine's report says which): each choice's generation begins; its job
        runs, no longer queued."""
        for seq in started:
            if seq.seq_id not in self._by_seq:
                continue  # its job already ended
            active, choice = self._by_seq[seq.seq_id]
            choice.admitted = True
            self.metrics.prompt_tokens.inc(seq.prompt_len)
            if not active.admitted:
                active.admitted = True
                self._count_queued(-1)
                self.metrics.running.inc()

    def _update_gauges(self) -> None:
        self.metrics.batch_rows.set(len(self.engine.running))
        self.metrics.waiting_sequences.set(len(self.engine.scheduler))
