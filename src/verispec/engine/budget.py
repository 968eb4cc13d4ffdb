"""A serving engine's prefill budget chosen from measured costs: how many prompt tokens one prefill chunk takes, so
that a long prompt arriving beside streaming clients slows their tokens by a bounded amount.

A step runs the decoding rows' verify pass and, while a prompt waits, its prefill chunk (its own forward,
engine/prefill.py; with the step's budget at the chunk's size, one chunk a step). A streaming client's inter-token
time while a long prompt is prefilled is then about decode + chunk. `choose_chunk_tokens` takes the widest chunk
whose measured forward costs at most `decode_steps` decode steps: the clients' inter-token time at most
(1 + decode_steps)x theirs alone, while the arriving prompt is prefilled in chunks as wide as that allows (a wide
forward runs the tiles at a better rate a token). Where even the narrowest chunk costs more (a slow or busy
machine: the bound cannot hold), every chunk stalls the streams anyway, and the total stall is the prompt's
tokens x the cost a token, which wide chunks make smaller: the widest chunk costing at most `FALLBACK_STEPS`
decode steps then (measured on the coder pair, 2 busy cores: a 16-token chunk cost 3 decode steps, and a
2,000-token prompt in 16-token chunks took 117 s beside 4 streams, its streams' p99 gap 4.5 s). `probe_chunk_costs`
measures the costs on the engine's own runner at start: a decode step (one token) and chunk widths ascending, each
the median of `repeats` after a warm-up, stopping after the first width over the bound that applies.

Chunk boundaries stay a function of the prompt alone (scheduler.py): the size is chosen once, at start.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

CHUNK_WIDTHS = (16, 32, 64, 128, 256, 512)  # the chunk sizes tried, narrowest first
DECODE_STEPS = 2.0  # default bound: a chunk's forward costs at most this many decode steps
FALLBACK_STEPS = 8.0  # the bound where even the narrowest chunk is over DECODE_STEPS (module docstring)
PROBE_CONTEXT = 64  # tokens in the cache while the probe times (a short prompt's context)


@dataclass(frozen=True)
class PrefillBudget:
    """The chosen chunk and step budget, with the costs behind them (for the log and /v1/stats)."""

    chunk_tokens: int  # most prompt tokens per prefill forward
    max_batched_tokens: int  # tokens fed a step: decoding rows, then chunks (one chunk a step beside decoding)
    decode_steps: float  # the bound the chunk was chosen under
    decode_ms: float  # one decode step (a one-token forward) measured
    chunk_ms: dict[int, float] = field(default_factory=dict)  # width -> its forward, measured

    def describe(self) -> str:
        costs = ", ".join(f"{w}: {ms:.1f} ms" for w, ms in sorted(self.chunk_ms.items()))
        return (f"prefill chunks of {self.chunk_tokens} tokens, {self.max_batched_tokens} tokens a step: the widest "
                f"chunk whose forward costs at most {self.decode_steps:g} decode steps ({self.decode_ms:.1f} ms "
                f"each; chunks {costs}); --prefill-chunk-tokens / --max-batched-tokens set them")


def bound_steps(chunk_s: Mapping[int, float], decode_s: float, decode_steps: float = DECODE_STEPS) -> float:
    """The bound that applies: decode_steps, or FALLBACK_STEPS (when larger) where the narrowest measured chunk is
    already over decode_steps. Pure."""
    narrowest = chunk_s[min(chunk_s)] if chunk_s else 0.0
    return max(decode_steps, FALLBACK_STEPS) if narrowest > decode_steps * decode_s else decode_steps


def choose_chunk_tokens(chunk_s: Mapping[int, float], decode_s: float, decode_steps: float = DECODE_STEPS) -> int:
    """The widest width of `chunk_s` (width -> seconds of its forward) costing at most decode_steps x decode_s;
    where the narrowest is over it, the widest costing at most FALLBACK_STEPS x decode_s; the narrowest when none
    does. Pure."""
    if not chunk_s:
        raise ValueError("choose_chunk_tokens needs at least one measured chunk width")
    if decode_steps <= 0:
        raise ValueError(f"decode_steps must be > 0, got {decode_steps}")
    steps = bound_steps(chunk_s, decode_s, decode_steps)
    fitting = [w for w, s in chunk_s.items() if s <= steps * decode_s]
    return max(fitting) if fitting else min(chunk_s)


def step_tokens(chunk_tokens: int, max_num_seqs: int) -> int:
    """Tokens fed a step: one chunk (a prompt always gets its one chunk a step; decoding rows are counted first), at
    least max_num_seqs (every decoding row's token). Pure."""
    return max(chunk_tokens, max_num_seqs)


def budget_from_costs(chunk_s: Mapping[int, float], decode_s: float, max_num_seqs: int,
                      decode_steps: float = DECODE_STEPS) -> PrefillBudget:
    """The budget of a server with max_num_seqs rows: chunks of `choose_chunk_tokens`, `step_tokens` a step."""
    chunk = choose_chunk_tokens(chunk_s, decode_s, decode_steps)
    return PrefillBudget(chunk, step_tokens(chunk, max_num_seqs), bound_steps(chunk_s, decode_s, decode_steps),
                         decode_s * 1e3, {w: s * 1e3 for w, s in chunk_s.items()})


@torch.inference_mode()
def probe_chunk_costs(runner, decode_steps: float = DECODE_STEPS, widths: tuple[int, ...] = CHUNK_WIDTHS,
                      repeats: int = 3, slot: int = 0) -> tuple[float, dict[int, float]]:
    """-> (seconds of a decode step, {width: seconds of a chunk forward}) on `runner`'s slot (emptied after), with
    PROBE_CONTEXT tokens in the cache; widths ascending, stopping after the first over the bound that applies
    (`bound_steps`: decode_steps, or FALLBACK_STEPS where the narrowest is already over it)."""
    from ..runtime.threads import governor

    widest = max(widths)
    tokens = torch.ones(1, PROBE_CONTEXT + widest, dtype=torch.long, device=runner.device)  # [1, n]: values do not matter

    def timed(width: int) -> float:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            with governor().step():
                start = time.perf_counter()
                runner.forward(tokens[:, PROBE_CONTEXT : PROBE_CONTEXT + width], start_slot=slot, last_only=True)
                times.append(time.perf_counter() - start)
            runner.truncate(PROBE_CONTEXT, slot)  # rollback: the probe never grows the context
        return statistics.median(times[1:])

    runner.reset(slot)
    try:
        with governor().step():
            runner.forward(tokens[:, :PROBE_CONTEXT], start_slot=slot, last_only=True)
        decode_s = timed(1)
        chunk_s: dict[int, float] = {}
        for width in sorted(widths):
            chunk_s[width] = timed(width)
            if chunk_s[width] > bound_steps(chunk_s, decode_s, decode_steps) * decode_s:
                break
    finally:
        runner.reset(slot)
    return decode_s, chunk_s
