"""`ModelRunner`: one Hugging Face causal LM plus its `PointerCache`.

The boundary the speculative loop talks to: `forward(token_ids)` appends tokens at the cache's current length
and returns their logits; `truncate(n)` rolls back. Batched verification (per-sequence positions, ragged
acceptance) and tree verification (custom attention masks) extend this class, not the loop: the loop only
ever asks for "logits of these new tokens given the kept prefix".
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from .kv_cache import PointerCache


class ModelRunner:
    def __init__(self, model: PreTrainedModel, max_len: int) -> None:
        self.model = model
        self.config = model.config
        self.max_len = max_len
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        num_layers = self.config.get_text_config().num_hidden_layers
        self.cache = PointerCache(num_layers, max_len)
        self.last_forward_s = 0.0

    @property
    def length(self) -> int:
        """Tokens whose keys/values are kept in the cache."""
        return self.cache.length

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def reset(self) -> None:
        self.cache.reset()

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Feed token_ids [1, n] at positions [length, length + n); -> logits [1, n, vocab] (or [1, 1, vocab])."""
        start = time.perf_counter()
        n = token_ids.shape[1]
        begin = self.cache.length
        if begin + n > self.max_len:
            raise ValueError(f"sequence of {begin + n} tokens exceeds max_len={self.max_len}; raise max_len")
        positions = torch.arange(begin, begin + n, device=self.device).unsqueeze(0)  # [1, n]
        out = self.model(
            input_ids=token_ids.to(self.device),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # honest timings for the adaptive controller
        self.last_forward_s = time.perf_counter() - start
        return out.logits
