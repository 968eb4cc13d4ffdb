"""A request as the server's threads pass it on: the `Job` a handler submits, and the events it gets back.

A handler turns a request into a `Job` and reads the job's events from its `JobHandle`: an `asyncio.Queue` that
the front end's threads and the engine thread fill through `loop.call_soon_threadsafe`, and a cancellation flag
they check (the client went away, or the deadline passed).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from ..config import SamplingParams, SpeculativeConfig
from ..engine import Continuation
from ..stats import GenerationStats
from .errors import APIError, timed_out
from .responses import TokenText
from .served import Prompt
from .tools import ToolCalling


# -- events, worker thread -> event loop -----------------------------------------------------------------------------


@dataclass
class Started:
    """The request passed every check that needs the tokenizer; its choices are queued for the batch."""

    prompt_tokens: int  # all prompts of the request, each counted once
    speculative: bool  # a drafter was found for the request (a named drafter may also resolve to none)
    resumed: int = 0  # a resumed stream (server/resume.py): the tokens its earlier replica streamed
    shown: str = ""  # ... the text it showed
    logprob_chars: int = 0  # ... and the characters of its tokens' logprob texts (completions' text_offset)


@dataclass
class TextDelta:
    index: int  # choice
    text: str  # newly committed text (one engine round)
    logprobs: list[TokenText] | None = None  # of the round's tokens, when the request asked for logprobs
    annotation: list[dict] | None = None  # how each of the round's tokens was decided, when the request asked
    token_ids: list[int] = field(default_factory=list)  # the round's tokens (reported with `Job.progress`)
    shown: int = 0  # characters of the choice's text shown so far, this round's included


@dataclass
class Echo:
    """A choice's prompt, echoed in front of its completion (`echo`), before any TextDelta of that choice."""

    index: int  # choice
    text: str  # the prompt as sent (token ids decoded)
    logprobs: list[TokenText] | None = None  # of the prompt's tokens (the first's null), when logprobs were asked


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


Event = Started | Echo | TextDelta | ChoiceDone | JobDone | JobFailed


class JobHandle:
    """The event loop's end of a job: its events, and a flag the front end and the worker check."""

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
        """Called on a front-end thread or the engine thread."""
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
    max_tokens: int | None  # None: up to the end of the context; 0: nothing generated (an echo of the prompt)
    n: int
    speculative: bool
    spec: SpeculativeConfig
    drafter_name: str | None
    handle: JobHandle
    annotate: bool = False  # the stream carries each token's origin (`speculative.annotate`)
    scope: str | None = None  # whose earlier requests a suffix drafter may draft from (a hash of the API key)
    key: str = ""  # a hash of the credentials it sent: whose online-trained head drafts for it (server/online.py)
    tools: ToolCalling | None = None  # the answer may be tool calls (their grammar is params.structured)
    progress: bool = False  # the stream reports its tokens for a failover (server/resume.py)
    resume: Continuation | None = None  # output an earlier replica streamed: this job goes on after it
    echo: bool = False  # each choice starts with its prompt (an `Echo`), with its logprobs when params ask for them
    prediction: str | None = None  # the answer's expected text: every choice drafts from it (drafters/prediction.py)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
