"""`Sequence`: one request's state in the engine: tokens, sampling state and random generator, stop checker,
drafter, speculation settings and statistics. The engine's step reads and advances sequences; nothing about a
request lives in the step's locals, so many requests advance together."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..config import SamplingParams, SpeculativeConfig
from .detokenize import StopChecker
from ..drafters.base import Drafter
from ..sampling import RowSamplingState
from ..stats import GenerationStats

_ids = itertools.count()


class SequenceStatus(str, Enum):
    """Where a request is; the scheduler alone moves it: waiting -> prefilling -> running -> finished (a cancelled
    request goes to finished from any of them)."""

    WAITING = "waiting"  # queued, no slot
    PREFILLING = "prefilling"  # admitted: its prompt is being prefilled into the slot it holds
    RUNNING = "running"  # decoding: slot == its row in the step
    FINISHED = "finished"  # left the engine (stopped or cancelled); slot -1


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the processed target distribution it was committed from (the
    verify pass's, the same numbers as the target alone), and the most likely alternatives there."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first; as many as the request asked for


@dataclass
class TokenOrigin:
    """How a committed token was decided (vocabulary as in DEVELOPERS.md); the server's opt-in annotation."""

    origin: str  # 'accepted' (a draft token the target kept), 'recovered', 'bonus', or 'target' (no draft)
    stage: str | None  # the drafter (a cascade's stage) that drafted this round; None for the target alone
    round: int  # the request's round that committed it, from 1
    drafted: int  # draft tokens proposed that round (K, or a tree's nodes)


def round_origins(stage: str | None, round: int, drafted: int, accepted: int, bonus: bool,
                  kept: int) -> list[TokenOrigin]:
    """A round's committed tokens: `accepted` draft tokens, then the recovered or bonus token (a round without
    draft tokens commits the target's own); a stop keeps only the first `kept`."""
    last = "target" if drafted == 0 else "bonus" if bonus else "recovered"
    origins = [TokenOrigin("accepted", stage, round, drafted) for _ in range(accepted)]
    origins.append(TokenOrigin(last, stage if drafted else None, round, drafted))
    return origins[:kept]


@dataclass(frozen=True)
class Continuation:
    """Output a request already generated and handed out elsewhere (a replica that died mid-stream), after which it
    goes on as one uninterrupted request: these tokens count as generated, not as prompt (penalties, min and max
    tokens, the coupled noise's output positions, the stop checker, the grammar), and only what follows them is
    handed out."""

    token_ids: tuple[int, ...]  # generated tokens already handed out, in order
    shown: int | None = None  # characters of their text already shown (None: as far as the stop checker allows)


@dataclass(eq=False)  # a request is itself: compared (and found in queues) by identity, never by its tensors
class Sequence:
    """One request. Invariant: tokens[:length] are the committed tokens (prompt, then generated)."""

    tokens: torch.Tensor  # [capacity] long on the target's device: committed tokens in [0, length)
    length: int  # committed tokens
    prompt_len: int
    params: SamplingParams
    spec: SpeculativeConfig  # this request's speculation settings
    sampling: RowSamplingState  # penalties' context, generated count
    generator: torch.Generator  # the request's own randomness: a seed gives the same draws alone or in a batch
    stopper: StopChecker
    drafter: Drafter | None  # None: the target alone (also after a drafter failure)
    stats: GenerationStats
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int = -1  # row in the runner's cache while being prefilled or decoding; -1 while waiting and after
    prefilled: int = 0  # prompt tokens already in the target's cache (chunked prefill; the scheduler's count)
    new_token_ids: list[int] = field(default_factory=list)  # committed since the caller last took them
    scope: str | None = None  # whose earlier requests a cross-request drafter may draft from (None: the default)
    logprobs: list[TokenLogprob] | None = None  # per generated token, when the request asked for logprobs
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # of new_token_ids
    new_origins: list[TokenOrigin] = field(default_factory=list)  # of new_token_ids
    wall_start: float = 0.0
    features: list[torch.Tensor] = field(default_factory=list)  # prefill hidden states awaiting the drafter's begin

    @property
    def finished(self) -> bool:
        return self.stopper.finish_reason is not None

    @property
    def finish_reason(self) -> str | None:
        return self.stopper.finish_reason

    @property
    def committed(self) -> torch.Tensor:
        """[length] view of the committed tokens (read-only by convention)."""
        return self.tokens[: self.length]

    @property
    def remaining(self) -> int:
        """Tokens this request may still generate."""
        return self.params.max_new_tokens - len(self.stopper.token_ids)

    def uniform(self, count: int) -> torch.Tensor:
        """count draws of U(0, 1) from this request's generator, on its device: [count]."""
        return torch.rand(count, generator=self.generator, device=self.tokens.device)

    def append(self, token_ids: list[int], logprobs: list[TokenLogprob] | None = None,
               origins: list[TokenOrigin] | None = None) -> None:
        """Commit tokens (already passed through the stop checker), with their logprobs when asked for."""
        end = self.length + len(token_ids)
        # One small host-to-device copy per row and round: the tokens were decided on the host (stop checks).
        self.tokens[self.length : end] = torch.tensor(token_ids, dtype=torch.long, device=self.tokens.device)
        self.length = end
        self.sampling.commit(token_ids)
        self.new_token_ids += token_ids
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += logprobs
            self.new_logprobs += logprobs
        self.new_origins += origins or []

    def take(self) -> tuple[list[int], str]:
        """The tokens committed and the text made safe to show since the last call."""
        token_ids, self.new_token_ids = self.new_token_ids, []
        return token_ids, self.stopper.take_text()

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The logprobs of the tokens committed since the last call (None when the request did not ask)."""
        if self.logprobs is None:
            return None
        taken, self.new_logprobs = self.new_logprobs, []
        return taken

    def take_origins(self) -> list[TokenOrigin]:
        """How each token committed since the last call was decided."""
        taken, self.new_origins = self.new_origins, []
        return taken


@dataclass
class GenerationChunk:
    """What one round hands the caller: the newly committed tokens and the text they complete."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # 'stop' | 'length' on the last chunk
    stats: GenerationStats | None = None  # the request's statistics, on the last chunk
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when the request asked for logprobs
    origins: list[TokenOrigin] = field(default_factory=list)  # of token_ids: how each was decided


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the request asked for logprobs
