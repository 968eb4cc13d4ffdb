"""Predicted speedup from measured acceptance and measured costs, and the timing probe that measures the costs.

Leviathan et al. (2023), generalised to a verify pass whose cost grows with its width. With K draft tokens per
round, alpha_i the probability that draft position i is accepted GIVEN positions 1..i-1 were (conditional),
c_draft the cost of one draft forward step and c_verify(w) the cost of a target forward over w new positions:

    E[committed tokens / round]  = 1 + sum_{j=1..K} prod_{i<=j} alpha_i
    time / round                 = K * c_draft + c_verify(K + 1)
    predicted speedup            = E * c_verify(1) / (K * c_draft + c_verify(K + 1))

(the target alone commits one token per c_verify(1)). Prefill and per-round bookkeeping are left out, so the
efficiency measured / predicted is what the implementation loses to them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch



def conditional_acceptance(accepted_by_position: Sequence[float]) -> list[float]:
    """Unconditional per-position acceptance (GenerationStats.acceptance_by_position: the share of rounds whose
    draft token at position j was accepted, which needs 1..j-1 accepted too) -> conditional alpha_j."""
    alphas = []
    previous = 1.0
    for rate in accepted_by_position:
        alphas.append(rate / previous if previous > 0 else 0.0)
        previous = rate
    return alphas


def expected_tokens_per_round(alphas: Sequence[float]) -> float:
    """1 + sum_j prod_{i<=j} alpha_i for conditional acceptance rates alphas[0..K-1]."""
    total, survive = 1.0, 1.0
    for alpha in alphas:
        survive *= alpha
        total += survive
    return total


def predicted_speedup(alphas: Sequence[float], c_draft: float, c_verify: Mapping[int, float]) -> float:
    """E * c_verify(1) / (K * c_draft + c_verify(K + 1)); K = len(alphas); c_verify maps width -> seconds."""
    k = len(alphas)
    return expected_tokens_per_round(alphas) * c_verify[1] / (k * c_draft + c_verify[k + 1])


def alphas_for_k(accepted_by_position: Sequence[float], k: int) -> list[float]:
    """Conditional alphas for exactly K positions (positions never proposed count as never accepted)."""
    alphas = conditional_acceptance(accepted_by_position)[:k]
    return alphas + [0.0] * (k - len(alphas))


@dataclass
class CostProbe:
    """Median seconds of one forward with a round's context in the KV cache (the prompt and `generated` tokens)."""

    prompt_tokens: int
    draft_step_s: float
    verify_s: dict[int, float] = field(default_factory=dict)  # width w -> c_verify(w)
    generated: int = 0  # tokens past the prompt in the KV cache when timed (half the run's new tokens)
    runner: str = ""  # the target runner's backend the probe timed (the engine's own kind and options)

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "context_tokens": self.prompt_tokens + self.generated,
                "runner": self.runner, "draft_step_ms": round(self.draft_step_s * 1e3, 3),
                "verify_ms": {str(w): round(s * 1e3, 3) for w, s in sorted(self.verify_s.items())}}


def _timed_forward(runner, tokens: torch.Tensor, keep: int, last_only: bool = False) -> float:
    start = time.perf_counter()
    runner.forward(tokens, last_only=last_only)  # [1, w] -> logits [1, w, vocab], as a verify pass computes them
    seconds = time.perf_counter() - start
    runner.truncate(keep)  # rollback: the probe never grows the cache
    return seconds


@torch.inference_mode()
def probe_costs(target, options, drafter, prompt_ids: Sequence[int], max_width: int, repeats: int = 5,
                generated: int = 0) -> CostProbe:
    """Time c_verify(w) for w = 1..max_width on a runner of the engine's kind and options (`make_runner(target, ...,
    options)`: the native runner shares the engine's weights and kernels), and c_draft, one token on the draft
    model the engine's drafter (a cascade's model stage) runs, each with the context a round has in the KV cache:
    the prompt and `generated` more tokens. A verify pass of width w is what a round of K = w - 1 pays (logits at
    every fed position); widths are interleaved within each repeat so machine drift hits all alike. A drafter
    without a model (n-gram, suffix) costs ~0 per step: c_draft 0."""
    from ..drafters.model import model_drafters
    from ..runtime.runners.select import make_runner

    prompt = list(prompt_ids)
    context = torch.as_tensor(prompt + prompt[-1:] * generated, dtype=torch.long)  # [n]: filler ids past the prompt
    keep = context.numel() - 1
    filler = context[-1:].repeat(max_width).unsqueeze(0)  # [1, max_width]: real token ids; values do not matter
    target_runner = make_runner(target, context.numel() + max_width + 1, 1, options)
    stage = next(iter(model_drafters(drafter)), None)
    draft_runner = (make_runner(stage.model, context.numel() + 2, 1, stage.options or options)
                    if stage is not None else None)
    for runner in filter(None, (target_runner, draft_runner)):  # (a cross-tokenizer draft has another vocabulary:
        runner.forward(context[:-1].remainder(runner.vocab_size).unsqueeze(0), last_only=True)  # ids taken mod its size)
    widths = range(1, max_width + 1)
    for width in widths:  # warm-up, not timed
        _timed_forward(target_runner, filler[:, :width], keep)
    verify: dict[int, list[float]] = {w: [] for w in widths}
    draft_times: list[float] = []
    for _ in range(repeats):
        for width in widths:
            verify[width].append(_timed_forward(target_runner, filler[:, :width], keep))
        if draft_runner is not None:
            for _ in range(2):
                draft_times.append(_timed_forward(draft_runner, filler[:, :1].remainder(draft_runner.vocab_size), keep,
                                                  last_only=True))
    return CostProbe(
        prompt_tokens=len(prompt),
        draft_step_s=statistics.median(draft_times) if draft_times else 0.0,
        verify_s={w: statistics.median(times) for w, times in verify.items()},
        generated=generated,
        runner=target_runner.backend,
    )
