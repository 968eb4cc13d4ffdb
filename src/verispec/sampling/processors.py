"""Batched logits processing with per-row parameters, shared by the target (p) and the drafter (q).

The same transforms, in the same order as Hugging Face `generate`, are applied to both distributions before
verification: repetition penalty, presence/frequency penalties, logit bias, min-new-tokens EOS mask, the
structured-output grammar mask, then (sampled rows only) temperature, top-k, top-p, min-p. That is what makes speculative sampling follow the *processed* target
distribution exactly.

Each row (sequence) has its own `SamplingParams`; a `RowSamplingState` keeps what its penalties see, and
`SamplingBatch.stack` stacks the rows of one step. Positions are processed in windows: position i of row b sees the
row's committed context plus `pending[b, :start + i]` (the round's draft tokens), so penalties and the
min-new-tokens mask match what sequential decoding would have seen at that position. Stages no row uses are
skipped on the host side (python flags), so an all-greedy batch costs a float cast and a slice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from ..config import SamplingParams
from .grammar import Grammar, grammar_masks
from .noise import gumbel_argmax, seed_halves

NEG_INF = float("-inf")


class NumericalError(RuntimeError):
    """The model produced NaN logits: sampling from them would be silently uniform."""


def stable_softmax(logits: Tensor) -> Tensor:
    """Softmax in fp32 with the max subtracted (torch does this internally; the cast is the point)."""
    return torch.softmax(logits.float(), dim=-1)


def check_finite(logits: Tensor, who: str) -> None:
    # One host sync per forward pass, not per token: the price of never sampling from NaN. The maximum propagates
    # NaN, so one reduction finds any (isnan().any() also wrote a bool copy: 0.34 vs 0.025 ms for 16 rows of a
    # 49,152 vocabulary on 2 threads, ~2% of a 16-row step); +-inf alone is no NaN.
    if logits.numel() and torch.isnan(logits.amax()):
        raise NumericalError(
            f"the {who} model produced NaN logits; try float32 (--dtype float32) or check the model weights"
        )


def _in_vocab(token_ids: Sequence[int] | Tensor, vocab_size: int, device: torch.device) -> Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device).reshape(-1)  # [n]
    return ids[(ids >= 0) & (ids < vocab_size)]


class RowSamplingState:
    """What one sequence's logits processing needs across steps: penalty context, output counts, generated count.

    The [vocab] tensors exist only when the row's params use them (most requests carry neither).
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Iterable[int],
        prompt_ids: Sequence[int] | Tensor,
        vocab_size: int,
        device: torch.device | str = "cpu",
        grammar: Grammar | None = None,
        noise_seed: int | None = None,
    ) -> None:
        """Raises ValueError for a logit_bias token outside the vocabulary. noise_seed: the seed of a coupled
        sampled row's noise (None: not coupled)."""
        self.params = params
        self.noise_seed = noise_seed
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # Masked until min_new_tokens: the model's EOS ids and the request's own stop ids.
        stops = set(int(t) for t in eos_token_ids) | set(params.stop_token_ids)
        self.eos_ids = _in_vocab(sorted(stops), vocab_size, self.device)  # [num_eos]
        self.num_generated = 0
        self.context_mask: Tensor | None = None  # [vocab] bool: prompt + output tokens (repetition penalty)
        if params.repetition_penalty != 1.0:
            self.context_mask = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            self.context_mask[_in_vocab(prompt_ids, vocab_size, self.device)] = True
        self.output_counts: Tensor | None = None  # [vocab] int32: occurrences in the output (presence/frequency)
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=self.device)
        self.logit_bias: Tensor | None = None  # [vocab] float32: OpenAI logit_bias, dense
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise ValueError(f"logit_bias token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
            self.logit_bias = torch.zeros(vocab_size, dtype=torch.float32, device=self.device)
            self.logit_bias[list(ids)] = torch.tensor(values, dtype=torch.float32, device=self.device)
        self.grammar = grammar  # the structured-output state: consumed = the committed output

    @property
    def allows_trees(self) -> bool:
        """Whether a position's processing depends only on the committed output and its depth, not on the draft
        tokens before it (no penalties or grammar), so a token tree's nodes can be processed side by side."""
        return self.context_mask is None and self.output_counts is None and self.grammar is None

    def commit(self, token_ids: Sequence[int] | Tensor) -> None:
        """Record tokens appended to the output (they are now context for every later position)."""
        count = len(token_ids)
        self.num_generated += count
        if self.grammar is not None:
            self.grammar.commit([int(t) for t in token_ids])
        if count == 0 or (self.context_mask is None and self.output_counts is None):
            return
        ids = _in_vocab(token_ids, self.vocab_size, self.device)  # [count]
        if self.context_mask is not None:
            self.context_mask[ids] = True
        if self.output_counts is not None:
            self.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))  # repeats add up


@dataclass
class SamplingBatch:
    """Per-row sampling state of one step, stacked from each row's SamplingParams (rows = sequences).

    Greedy rows carry top_k 0, top_p 1 and min_p 0 whatever their params say: those stages never touch them.
    """

    temperature: Tensor  # [batch] float32
    """Temperature per row; 0 for greedy rows."""
    top_k: Tensor  # [batch] long
    """Top-k per row; 0 = off (also when top_k >= vocab, or the row is greedy)."""
    top_p: Tensor  # [batch] float32
    """Top-p per row; 1 = off."""
    min_p: Tensor  # [batch] float32
    """Min-p per row; 0 = off."""
    repetition_penalty: Tensor  # [batch] float32
    """HF/CTRL repetition penalty over prompt + output tokens; 1 = off."""
    presence_penalty: Tensor  # [batch] float32
    """OpenAI presence penalty over output tokens only, subtracted once when the count is > 0; 0 = off."""
    frequency_penalty: Tensor  # [batch] float32
    """OpenAI frequency penalty, subtracted once per occurrence in the output; 0 = off."""
    num_generated: Tensor  # [batch] long
    """Tokens generated so far per row (for min_new_tokens)."""
    min_new_tokens: Tensor  # [batch] long
    """EOS and stop ids are masked while the generated count is below this."""
    eos_mask: Tensor | None  # [batch, vocab] bool
    """Ids masked while a row is below min_new_tokens; None when no row is below it at this step."""
    context_mask: Tensor | None  # [batch, vocab] bool
    """Tokens of prompt + output per row; None when no row has a repetition penalty."""
    output_counts: Tensor | None  # [batch, vocab] int32
    """Occurrences of each token in the output per row; None when no row has presence/frequency penalties."""
    logit_bias: Tensor | None  # [batch, vocab] float32
    """Added to each row's logits (OpenAI logit_bias); None when no row has one."""
    grammars: list[tuple[int, Grammar]]
    """(row, grammar) of rows with structured output; their masks are computed per position on the host."""
    greedy: Tensor  # [batch] bool
    """Rows decoded by argmax (temperature 0)."""
    coupled: tuple[bool, ...]
    """Per row, on the host: a sampled row whose tokens are coupled choices (sampling/noise.py), not drawn from q."""
    noise_seeds: Tensor | None  # [batch, 2] int64
    """Each coupled row's seed as two 32-bit halves (0 in other rows); None when no row is coupled."""
    all_greedy: bool
    """No row samples: the temperature/top-k/top-p/min-p stages are skipped."""
    max_top_k: int
    """Largest top-k of any row (0: the top-k stage is skipped)."""
    top_p_rows: Tensor | None  # [num_top_p_rows] long
    """Rows with top_p < 1 (the only ones sorted); None when no row uses top-p."""
    any_min_p: bool
    """Some row uses min-p."""
    vocab_size: int
    """Tokens of the tokenizer; logits are sliced to this many columns."""

    def to(self, device: torch.device | str) -> SamplingBatch:
        """The same batch with its tensors on `device` (a draft model on another device than the target's); itself
        where they are there already."""
        if self.temperature.device == torch.device(device):
            return self
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})

    @classmethod
    def stack(cls, rows: Sequence[RowSamplingState], vocab_size: int, device: torch.device | str) -> SamplingBatch:
        """Stack the rows of one step: O(batch) scalars, O(batch * vocab) copies at most, no vocabulary loops."""
        device = torch.device(device)
        params = [row.params for row in rows]
        greedy = [p.greedy for p in params]

        def column(values: list, dtype: torch.dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype, device=device)  # [batch]

        top_k = [0 if g or p.top_k >= vocab_size else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        early = [row.num_generated < row.params.min_new_tokens and row.eos_ids.numel() > 0 for row in rows]
        eos_mask = None
        if any(early):
            eos_mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)  # [batch, vocab]
            for i, row in enumerate(rows):
                if early[i]:
                    eos_mask[i, row.eos_ids.to(device)] = True
        context_mask = None
        if any(row.context_mask is not None for row in rows):
            off = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [vocab]
            context_mask = torch.stack([off if r.context_mask is None else r.context_mask.to(device) for r in rows])
        output_counts = None
        if any(row.output_counts is not None for row in rows):
            zero = torch.zeros(vocab_size, dtype=torch.int32, device=device)  # [vocab]
            output_counts = torch.stack([zero if r.output_counts is None else r.output_counts.to(device) for r in rows])
        logit_bias = None
        if any(row.logit_bias is not None for row in rows):
            zero = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # [vocab]
            logit_bias = torch.stack([zero if r.logit_bias is None else r.logit_bias.to(device) for r in rows])
        top_p_rows = [i for i, value in enumerate(top_p) if value < 1.0]
        coupled = tuple(row.noise_seed is not None for row in rows)
        noise_seeds = None
        if any(coupled):
            halves = [seed_halves(0 if row.noise_seed is None else row.noise_seed) for row in rows]
            noise_seeds = torch.tensor(halves, dtype=torch.long, device=device)  # [batch, 2]
        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column(top_k, torch.long),
            top_p=column(top_p, torch.float32),
            min_p=column(min_p, torch.float32),
            repetition_penalty=column([p.repetition_penalty for p in params], torch.float32),
            presence_penalty=column([p.presence_penalty for p in params], torch.float32),
            frequency_penalty=column([p.frequency_penalty for p in params], torch.float32),
            num_generated=column([row.num_generated for row in rows], torch.long),
            min_new_tokens=column([p.min_new_tokens for p in params], torch.long),
            eos_mask=eos_mask,
            context_mask=context_mask,
            output_counts=output_counts,
            logit_bias=logit_bias,
            grammars=[(i, row.grammar) for i, row in enumerate(rows) if row.grammar is not None],
            greedy=column(greedy, torch.bool),
            coupled=coupled,
            noise_seeds=noise_seeds,
            all_greedy=all(greedy),
            max_top_k=max(top_k, default=0),
            top_p_rows=column(top_p_rows, torch.long) if top_p_rows else None,
            any_min_p=any(value > 0 for value in min_p),
            vocab_size=vocab_size,
        )


def _pending_counts(pending: Tensor, window: Tensor, vocab: int, n: int) -> Tensor:
    """Occurrences of each token among pending[b, :window[b, i]], per position.

    pending: [batch, m] long; window: [batch or 1, n] long in 0..m -> [batch, n, vocab] float32
    """
    batch, m = pending.shape
    seen = torch.arange(m, device=pending.device) < window.unsqueeze(-1)  # [batch or 1, n, m]
    index = pending.clamp(0, vocab - 1).unsqueeze(1).expand(batch, n, m)  # [batch, n, m]
    counts = torch.zeros(batch, n, vocab, device=pending.device)  # [batch, n, vocab]
    return counts.scatter_add_(-1, index, seen.expand(batch, n, m).float())


def process_logits(
    logits: Tensor,  # [batch, n, vocab'] any float dtype, vocab' >= vocab_size
    batch: SamplingBatch,
    pending: Tensor | None = None,  # [batch, m] long
    start: int | Tensor = 0,  # int, or [batch] long
    depths: Tensor | None = None,  # [batch, n] long: a token tree's node depths (position i follows depths[b, i] drafts)
) -> Tensor:
    """Apply each row's penalties and sampling transforms. Removed tokens get -inf.

    logits: [batch, n, vocab'] any float dtype, vocab' >= vocab_size (padded output layers are sliced);
    pending: [batch, m] long, the round's draft tokens: position i of row b sees pending[b, :start + i] (clamped to m);
    start: int, or [batch] long. -> processed fp32 logits [batch, n, vocab_size]
    """
    vocab = batch.vocab_size
    logits = logits[..., :vocab].float()  # [batch, n, vocab]
    rows, n, _ = logits.shape
    device = logits.device
    steps = torch.arange(n, device=device) if depths is None else depths.to(device)  # [n] or [batch, n]
    offset = torch.as_tensor(start, device=device).reshape(-1, 1) + steps  # [batch or 1, n]
    penalised = batch.context_mask is not None or batch.output_counts is not None
    pending_counts = None
    if penalised and pending is not None and pending.shape[1] > 0:
        window = offset.clamp_max(pending.shape[1])  # [batch or 1, n]
        pending_counts = _pending_counts(pending.to(device), window, vocab, n)  # [batch, n, vocab]
    if batch.context_mask is not None:
        seen = batch.context_mask.unsqueeze(1)  # [batch, 1, vocab]
        if pending_counts is not None:
            seen = seen | (pending_counts > 0)  # [batch, n, vocab]
        penalty = batch.repetition_penalty.view(rows, 1, 1)  # [batch, 1, 1]
        penalised_logits = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(seen, penalised_logits, logits)
    if batch.output_counts is not None:
        counts = batch.output_counts.unsqueeze(1).float()  # [batch, 1, vocab]
        if pending_counts is not None:
            counts = counts + pending_counts  # [batch, n, vocab]
        frequency = batch.frequency_penalty.view(rows, 1, 1)  # [batch, 1, 1]
        presence = batch.presence_penalty.view(rows, 1, 1)  # [batch, 1, 1]
        logits = logits - frequency * counts - presence * (counts > 0).float()
    if batch.logit_bias is not None:
        logits = logits + batch.logit_bias.unsqueeze(1)
    if batch.eos_mask is not None:
        generated = batch.num_generated.unsqueeze(1) + offset  # [batch, n]
        too_early = (generated < batch.min_new_tokens.unsqueeze(1)).unsqueeze(-1)  # [batch, n, 1]
        logits = logits.masked_fill(too_early & batch.eos_mask.unsqueeze(1), NEG_INF)
    if batch.grammars:
        allowed = grammar_masks(batch.grammars, rows, pending, offset, n, vocab, device)  # [batch, n, vocab]
        logits = logits.masked_fill(~allowed, NEG_INF)
    if batch.all_greedy:
        return logits
    # Greedy rows divide by 1 and carry the "off" value of every later stage: they stay the penalised logits.
    temperature = torch.where(batch.greedy, 1.0, batch.temperature).view(rows, 1, 1)  # [batch, 1, 1]
    logits = logits / temperature
    if batch.max_top_k > 0:
        logits = _top_k(logits, batch.top_k, batch.max_top_k)
    if batch.top_p_rows is not None:
        logits = _top_p(logits, batch.top_p, batch.top_p_rows)
    if batch.any_min_p:
        probs = logits.softmax(dim=-1)  # [batch, n, vocab]
        floor = batch.min_p.view(rows, 1, 1) * probs.amax(dim=-1, keepdim=True)  # [batch, n, 1]
        logits = logits.masked_fill(probs < floor, NEG_INF)
    return logits


def _top_k(logits: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    """Keep tokens at least as likely as the row's k-th (ties kept, as HF).

    logits: [batch, n, vocab]; top_k: [batch] long, 0 = off -> [batch, n, vocab]
    """
    top = logits.topk(max_top_k, dim=-1).values  # [batch, n, max_top_k], descending
    rank = (top_k - 1).clamp_min(0).view(-1, 1, 1).expand(-1, logits.shape[1], 1)  # [batch, n, 1]
    kth = top.gather(-1, rank)  # [batch, n, 1]
    kth = torch.where((top_k > 0).view(-1, 1, 1), kth, NEG_INF)  # rows with top_k off keep everything
    return logits.masked_fill(logits < kth, NEG_INF)


def _top_p(logits: Tensor, top_p: Tensor, top_p_rows: Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, only on `top_p_rows`.

    logits: [batch, n, vocab]; top_p: [batch]; top_p_rows: [r] long (rows with top_p < 1; the others are not
    sorted, and fp rounding of a cumulative sum can never drop their tail).
    """
    whole = top_p_rows.numel() == logits.shape[0]
    sub = logits if whole else logits[top_p_rows]  # [r, n, vocab]
    sorted_logits, order = sub.sort(dim=-1, descending=True)  # [r, n, vocab]
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [r, n, vocab]
    drop_sorted = mass_before >= top_p[top_p_rows].view(-1, 1, 1)  # the most likely token is never dropped
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # [r, n, vocab]
    sub = sub.masked_fill(drop, NEG_INF)
    if whole:
        return sub
    logits = logits.clone()
    logits[top_p_rows] = sub
    return logits


def sample_from_probs(probs: Tensor, uniform: Tensor) -> Tensor:
    """Inverse-CDF sampling with the noise passed in: the first token whose cumulative mass exceeds u * total.

    probs: [rows, vocab] (need not sum to exactly 1); uniform: [rows] in [0, 1) -> [rows] long.
    The caller draws `uniform` from each row's own generator, so a seeded row samples the same alone or in a batch.
    Never returns a token of probability 0: a zero-mass token does not raise the cumulative sum, and when fp
    rounding puts u * total at or past the last cumulative value the last token with mass is taken.
    """
    probs = probs.float()
    cdf = probs.cumsum(dim=-1)  # [rows, vocab], non-decreasing
    target = (uniform.to(cdf.device).float() * cdf[:, -1]).unsqueeze(-1)  # [rows, 1]
    token = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [rows], vocab when past the end
    positions = torch.arange(probs.shape[-1], device=probs.device)  # [vocab]
    last_with_mass = torch.where(probs > 0, positions, 0).amax(dim=-1)  # [rows]
    return torch.where(token < probs.shape[-1], token, last_with_mass)


def row_choices(logits: Tensor, batch: SamplingBatch, start: int = 0, depths: Tensor | None = None) -> Tensor:
    """Each row's own token at each position from its processed logits: the coupled choice in coupled rows, the
    argmax elsewhere (greedy rows' token; unused in rejection-sampled rows).

    logits: [batch, n, vocab] processed; position i of row b is output position num_generated[b] + start + i, or
    + start + depths[b, i] in a token tree ([batch, n] long) -> [batch, n] long.
    """
    # max's indices are argmax's (the first maximum; NaN wins) at a quarter of its time on bf16 CPU logits (3.1 vs
    # 0.74 ms for 16 rows of a 49,152 vocabulary, one thread): a 16-row step's largest cost outside the model
    choices = logits.max(dim=-1).indices  # [batch, n]
    if batch.noise_seeds is None:
        return choices
    rows, n, _ = logits.shape
    steps = torch.arange(n, device=logits.device) if depths is None else depths.to(logits.device)  # [n] | [batch, n]
    positions = (batch.num_generated.to(logits.device).unsqueeze(1) + start + steps).expand(rows, n)  # [batch, n]
    seeds = batch.noise_seeds.to(logits.device)  # [batch, 2]: a drafter may run on another device than the target
    if all(batch.coupled):
        return gumbel_argmax(logits, seeds, positions)
    index = torch.tensor([i for i, c in enumerate(batch.coupled) if c], device=logits.device)  # [coupled rows]
    coupled = gumbel_argmax(logits[index], seeds[index], positions[index])  # [coupled rows, n]
    return choices.index_copy(0, index, coupled)
