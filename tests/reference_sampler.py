"""TokenSampler: the logits processing of ONE sequence, written the simple way (the pre-batching engine's).

Test-only: the batched engine uses `verispec.sampling.process_logits` over a `SamplingBatch`, and
tests/unit/test_processors.py checks it row by row against this reference (tests/unit/test_sampling.py checks this
reference against Hugging Face's processors). Row i of a window of logits sees the committed context plus the first `start + i` tokens of `pending`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from verispec.config import SamplingParams
from verispec.sampling.processors import stable_softmax


class TokenSampler:
    """Processing state of one sequence: what penalties see, how many tokens were generated, the RNG."""

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        context_ids: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=self.device)
        self.num_generated = 0
        self.generator = torch.Generator(device=self.device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.presence: torch.Tensor | None = None  # [vocab] bool, only with a repetition penalty
        if params.repetition_penalty != 1.0:
            self.presence = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            self._mark(context_ids)

    def _mark(self, token_ids: Sequence[int] | torch.Tensor) -> None:
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
        self.presence[ids[ids < self.vocab_size]] = True

    def commit(self, token_ids: Sequence[int]) -> None:
        """Record tokens appended to the sequence (they are now context for every later position)."""
        self.num_generated += len(token_ids)
        if self.presence is not None and len(token_ids):
            self._mark(token_ids)

    def process(self, logits: torch.Tensor, pending: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        """Apply penalties and sampling transforms. logits: [n, vocab] -> processed fp32 logits [n, vocab].

        pending: [m] long, the round's draft tokens; row i sees the context plus pending[: start + i].
        Removed tokens get -inf.
        """
        params = self.params
        logits = logits.float()
        n, vocab = logits.shape
        if vocab != self.vocab_size:  # models may pad their output layer past the tokenizer
            logits = logits[:, : self.vocab_size] if vocab > self.vocab_size else logits
        if self.presence is not None:
            presence = self._window_presence(n, pending, start)  # [n, vocab]
            penalised = torch.where(logits < 0, logits * params.repetition_penalty, logits / params.repetition_penalty)
            logits = torch.where(presence, penalised, logits)
        if params.min_new_tokens > 0 and self.eos_token_ids.numel():
            generated = self.num_generated + start + torch.arange(n, device=logits.device)  # [n]
            too_early = (generated < params.min_new_tokens).unsqueeze(-1)  # [n, 1]
            eos = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            eos[self.eos_token_ids[self.eos_token_ids < logits.shape[-1]]] = True
            logits = logits.masked_fill(too_early & eos, float("-inf"))
        if params.greedy:
            return logits
        logits = logits / params.temperature
        if params.top_k > 0 and params.top_k < logits.shape[-1]:
            kth = logits.topk(params.top_k, dim=-1).values[:, -1:]  # [n, 1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [n, vocab]
            drop_sorted = mass_before >= params.top_p  # the most likely token is never dropped
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        if params.min_p > 0:
            probs = logits.softmax(dim=-1)
            floor = params.min_p * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < floor, float("-inf"))
        return logits

    def _window_presence(self, n: int, pending: torch.Tensor | None, start: int) -> torch.Tensor:
        base = self.presence.unsqueeze(0).expand(n, -1)
        if pending is None or pending.numel() == 0:
            return base
        seen = torch.zeros(pending.numel() + 1, self.vocab_size, dtype=torch.bool, device=self.device)
        seen[torch.arange(1, pending.numel() + 1), pending.clamp_max(self.vocab_size - 1)] = True
        seen = seen.cumsum(dim=0) > 0  # row j: tokens among pending[:j]
        rows = (start + torch.arange(n, device=self.device)).clamp_max(pending.numel())
        return base | seen[rows]

    def probs(self, processed: torch.Tensor) -> torch.Tensor:
        """Processed logits [n, vocab] -> probabilities [n, vocab] (fp32)."""
        return stable_softmax(processed)

    def pick(self, processed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row: argmax when greedy, else a sample. -> (tokens [n], probs [n, vocab] or None)."""
        if self.params.greedy:
            return processed.argmax(dim=-1), None
        probs = self.probs(processed)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1), probs
