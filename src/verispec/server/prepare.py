"""The server's front end: a job's engine inputs, built on a small thread pool before the engine thread sees it.

Preparing a job tokenizes its prompts (chat messages through the tokenizer's chat template), checks them against
the vocabulary and the context, and compiles each choice's grammar; the engine thread then only adds the
prepared sequences, steps and posts (server/worker.py), so a large JSON schema or a long prompt holds up no
stream. Both heavy parts run beside a step rather than between two: the tokenizer's encode and llguidance's
compiler release the GIL while they work. Measured (2 cores): a Python thread beside them is never stalled for
longer than the machine's scheduling noise (~12 ms) while a 96k-character prompt encodes (106 ms) or a schema
compiles (`LLMatcher`, 507 ms); only the schema's translation to a grammar (`grammar_source`, ~10% of a compile)
holds the GIL, for up to ~30 ms on an 800-property schema.

Thread safety: the tokenizer is only read (no call sets truncation or padding, so encoding on these threads and
decoding on the engine thread never conflict), `engine.new_grammar` reads fixed sizes, and the compiled-grammar
cache is locked (sampling/grammar.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ..config import SamplingParams
from ..engine import Continuation
from ..sampling.grammar import Grammar
from .constraints import constraint_param
from .errors import APIError, invalid
from .jobs import Job
from .served import ServedModel
from .tools import schema_errors

logger = logging.getLogger("verispec.server")

PREPARE_THREADS = 2  # a large schema compiling on one thread leaves the other for the requests behind it


@dataclass
class PreparedChoice:
    """One engine sequence of a job: prompt x n choices."""

    prompt_ids: list[int]
    params: SamplingParams  # max_new_tokens filled in (max_tokens or the rest of the context); seed + choice
    grammar: Grammar | None  # this sequence's own grammar state, compiled (None without a constraint)
    resume: Continuation | None = None  # output an earlier replica streamed (the job's, for its one choice)
    prediction: list[int] | None = None  # the job's prediction, tokenized (each choice drafts from its own copy)


@dataclass
class PreparedJob:
    job: Job
    choices: list[PreparedChoice]  # in choice order
    prompt_tokens: int  # all prompts of the request, each counted once


def prepare(served: ServedModel, job: Job) -> PreparedJob:
    """Everything a job needs before the engine: token ids, checked lengths and grammars.

    Raises APIError (a 400) for a prompt that cannot be encoded, a context too short for it, or a constraint
    that does not compile: every check happens before the first token, so a bad request streams nothing. A job
    with max_tokens 0 (an echo of its prompts, nothing generated) only has its prompts checked."""
    prompts = [served.encode(prompt, job.prompt_param) for prompt in job.prompts]
    prompt_tokens = sum(len(ids) for ids in prompts)
    if job.max_tokens == 0:
        for ids in prompts:
            served.check_prompt(len(ids), job.prompt_param)
        return PreparedJob(job, [PreparedChoice(prompts[i // job.n], job.params, None)
                                 for i in range(len(prompts) * job.n)], prompt_tokens)
    prediction = None if job.prediction is None else served.encode_prediction(job.prediction)
    choices: list[PreparedChoice] = []
    for index in range(len(prompts) * job.n):
        ids = prompts[index // job.n]
        seed = None if job.params.seed is None else job.params.seed + index % job.n
        max_new_tokens = job.max_tokens or max(1, served.config.max_len - len(ids))
        try:
            params = replace(job.params, max_new_tokens=max_new_tokens, seed=seed)
        except ValueError as exc:
            raise invalid(str(exc), param="min_tokens") from exc
        served.check_request(len(ids), params, job.prompt_param)
        if prediction is not None:
            served.check_prediction(len(ids), len(prediction))
        choices.append(PreparedChoice(ids, params, None, job.resume, prediction))
    for choice in choices:  # after the length checks: a request refused for its length compiles nothing
        try:
            choice.grammar = served.engine.new_grammar(choice.params)
        except ValueError as exc:  # the request's grammar does not compile
            raise _grammar_error(job, exc) from exc
    return PreparedJob(job, choices, prompt_tokens)


def _grammar_error(job: Job, exc: ValueError) -> APIError:
    """A 400 naming the field whose constraint does not compile: for tools, the function whose parameters schema
    llguidance refuses (looked for only now, on the error's path)."""
    if job.tools is None:
        return invalid(str(exc), param=constraint_param(job.params))
    found = schema_errors(job.tools.request)
    if found is None:
        return invalid(f"the tools' grammar cannot be compiled: {exc}", param="tools")
    index, why = found
    name = job.tools.request.tools[index].name
    return invalid(f"the parameters of tool `{name}` are not a JSON schema llguidance can compile: {why}",
                   param=f"tools.{index}.function.parameters")


class FrontEnd:
    """Prepares jobs on `PREPARE_THREADS` threads and hands each one on as soon as it is ready (so a slow job
    never holds up a quick one behind it): `ready(prepared)` for a job to run, `dropped(job, error)` for one that
    ends here, with its error, or None when its client left before it was ready (it never reaches the engine)."""

    def __init__(self, served: ServedModel, ready: Callable[[PreparedJob], None],
                 dropped: Callable[[Job, APIError | None], None]) -> None:
        self.served = served
        self._ready = ready
        self._dropped = dropped
        self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="verispec-prepare")
        self._closed = False

    def submit(self, job: Job) -> None:
        self._pool.submit(self._prepare, job)

    def shutdown(self) -> None:
        """Cancel the jobs not prepared yet (they are dropped); one being prepared is dropped once ready."""
        self._closed = True
        self._pool.shutdown(wait=False)

    def _prepare(self, job: Job) -> None:
        if self._closed:
            job.handle.cancel()
        if job.handle.cancelled:
            self._dropped(job, None)
            return
        try:
            prepared = prepare(self.served, job)
        except APIError as error:
            self._dropped(job, error)
            return
        except Exception as exc:  # noqa: BLE001 - one bad job must never take a front-end thread down
            logger.exception("preparing a generation failed")
            self._dropped(job, internal_error(exc))
            return
        if self._closed:
            job.handle.cancel()
        if job.handle.cancelled:  # the client left while its job was being prepared
            self._dropped(job, None)
        else:
            self._ready(prepared)


def internal_error(exc: Exception) -> APIError:
    return APIError(500, f"Generation failed ({type(exc).__name__}: {exc}).", type="server_error")
