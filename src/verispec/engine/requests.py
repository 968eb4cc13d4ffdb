"""A request becomes a `Sequence`: its token buffer, randomness, logits processing (with a compiled grammar),
stop checker and statistics, everything the step reads and advances."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..config import SamplingParams, SpeculativeConfig
from .detokenize import StopChecker
from ..drafters.base import Drafter
from ..sampling import Grammar, RowSamplingState
from ..stats import GenerationStats
from .sequence import Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def model_eos_ids(model: PreTrainedModel, tokenizer=None) -> set[int]:
    """All EOS ids of the model's generation config (one or several), plus the tokenizer's EOS id."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def new_sequence(prompt: torch.Tensor, params: SamplingParams, spec: SpeculativeConfig, drafter: Drafter | None,
                 tokenizer, vocab_size: int, device: torch.device, eos_token_ids: set[int], slack: int,
                 grammar: Grammar | None) -> Sequence:
    """A waiting sequence for prompt [n] (copied); its buffer holds prompt + max_new_tokens + slack (the widest verify
    pass's positions past the committed tokens). `grammar`: the request's compiled constraint (`row_grammar`)."""
    tokens = torch.empty(prompt.numel() + params.max_new_tokens + slack, dtype=torch.long, device=device)
    tokens[: prompt.numel()] = prompt.to(device)
    generator = torch.Generator(device=device)
    if params.seed is not None:
        generator.manual_seed(params.seed)
    else:
        generator.seed()
    # Coupled sampling keys its noise by (seed, output position); an unseeded request's seed is drawn once, here.
    noise_seed = None
    if params.coupled and not params.greedy:
        noise_seed = params.seed if params.seed is not None else generator.initial_seed()
    eos = eos_token_ids | set(params.stop_token_ids)
    return Sequence(
        tokens=tokens,
        length=prompt.numel(),
        prompt_len=prompt.numel(),
        params=params,
        spec=spec,
        sampling=RowSamplingState(params, eos, prompt.tolist(), vocab_size, device, grammar, noise_seed),
        generator=generator,
        stopper=StopChecker(params, eos_token_ids, tokenizer, params.max_new_tokens),
        drafter=drafter,
        stats=GenerationStats(prompt_tokens=prompt.numel(), requests=1, acceptance_mode=acceptance_label(spec),
                              lossy=not spec.lossless),
        wall_start=time.perf_counter(),
        logprobs=None if params.logprobs is None else [],
    )


def acceptance_label(spec: SpeculativeConfig) -> str:
    """'exact', or 'top_k:N' for the LOSSY mode (as `--acceptance` spells it)."""
    return "exact" if spec.lossless else f"{spec.acceptance}:{spec.acceptance_top_k}"
