"""A request becomes a `Sequence`: its token buffer, randomness, logits processing (with a compiled grammar),
stop checker and statistics, everything the step reads and advances."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ..config import SamplingParams, SpeculativeConfig
from .detokenize import StopChecker
from ..drafters.base import Drafter
from ..runtime.model.chat_templates import end_of_turn_ids
from ..sampling import Grammar, RowSamplingState
from ..stats import GenerationStats
from .sequence import Continuation, Sequence

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def model_eos_ids(model: PreTrainedModel, tokenizer=None) -> set[int]:
    """All EOS ids of the model's generation config (one or several), plus the tokenizer's EOS id and the tokens
    that end a turn in its chat template (`chat_templates.end_of_turn_ids`: Gemma 3's `<end_of_turn>`)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if tokenizer is not None:
        ids |= end_of_turn_ids(tokenizer)
    return ids


def new_sequence(prompt: torch.Tensor, params: SamplingParams, spec: SpeculativeConfig, drafter: Drafter | None,
                 tokenizer, vocab_size: int, device: torch.device, eos_token_ids: set[int], slack: int,
                 grammar: Grammar | None, resume: Continuation | None = None) -> Sequence:
    """A waiting sequence for prompt [n] (copied); its buffer holds prompt + max_new_tokens + slack (the widest verify
    pass's positions past the committed tokens). `grammar`: the request's compiled constraint (`row_grammar`).
    `resume`: output already generated (`resume_output`)."""
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
    seq = Sequence(
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
    if resume is not None:
        resume_output(seq, resume)
    return seq


def resume_output(seq: Sequence, resume: Continuation) -> None:
    """Replay output generated before into a waiting sequence, as its own rounds would have committed it: the stop
    checker (text, stop strings), the sampling state (penalty counts, min_tokens, the grammar, the coupled noise's
    next output position) and the buffer; the prefill then covers prompt + that output. Nothing of it is handed
    out again: the text shown continues at `resume.shown`. Output that ends the request (its stop token or string,
    or its length: the last tokens an earlier replica streamed before it could say so) leaves the sequence
    finished. Raises ValueError for output that goes on past its end or that its grammar refuses."""
    ids = [int(t) for t in resume.token_ids]
    if not ids:
        return
    if len(ids) > seq.params.max_new_tokens:
        raise ValueError(f"the continuation's {len(ids)} tokens are more than max_new_tokens "
                         f"({seq.params.max_new_tokens})")
    for i, token in enumerate(ids):
        if seq.stopper.push(token) is not None and i < len(ids) - 1:
            raise ValueError("the continuation goes on past the request's end (a stop token or string)")
    seq.append(ids)
    seq.new_token_ids = []
    if seq.sampling.grammar is not None and seq.sampling.grammar.broken:
        raise ValueError("the continuation's tokens do not follow the request's structured output")
    if resume.shown is None:
        seq.stopper.take_text()
    elif 0 <= resume.shown <= len(seq.stopper.text):
        seq.stopper.emitted = resume.shown
    else:
        raise ValueError(f"the continuation showed {resume.shown} characters of a {len(seq.stopper.text)}-character "
                         "text")
    seq.prompt_len = seq.length  # the prefill covers the output replayed (a prefix cache still serves the prompt)


def acceptance_label(spec: SpeculativeConfig) -> str:
    """'exact', or 'top_k:N' for the LOSSY mode (as `--acceptance` spells it)."""
    return "exact" if spec.lossless else f"{spec.acceptance}:{spec.acceptance_top_k}"
