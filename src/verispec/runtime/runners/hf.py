"""`HFRunner`: one Hugging Face causal LM plus its `SlotCache`, behind the interface the engine talks to.

    forward(token_ids [batch, n], start_slot, positions, tree_mask, logits_at, want_hidden) -> RunnerOutput

Row b of a forward is the sequence in slot start_slot + b. Its n tokens are written after that slot's kept
entries (cache index lengths[slot] + t), at rotary/learned positions `positions` (default: the same indices;
a token tree passes depths instead), attending under a 4D mask built here (kv_cache.attention_mask). After the
forward every slot of the batch has grown by n; the engine then sets each slot's kept length (rollback and
padding are bookkeeping). The native runner (native.py) implements the same methods without the engine changing.

Not batch-invariant: Hugging Face modeling's kernels sum in an order that depends on the verify width and the
batch, so a wide verify pass can differ from a one-token step in the last bits (greedy output stays equal in
fp32; logprobs to ~1e-5). `RunnerOptions.batch_invariant` applies to the native runner only (invariant.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .base import RunnerOutput, SlotRunner
from ..caches.kv_cache import SlotCache, StepLayout, attention_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class HFRunner(SlotRunner):
    """A Hugging Face model with `num_slots` sequences' KV caches of `max_len` entries each."""

    backend = "hf"
    compiled = False
    compile_s = 0.0

    def __init__(self, model: PreTrainedModel, max_len: int, num_slots: int = 1) -> None:
        self.model = model
        self.config = model.config
        self.max_len = max_len
        self.num_slots = num_slots
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        text_config = self.config.get_text_config()
        self.cache = SlotCache(text_config.num_hidden_layers, num_slots, max_len)
        # Learned position tables (GPT-2) have an end; padding rows may run past it, real tokens never do.
        self.max_position = getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None)
        self.last_forward_s = 0.0

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [batch, n] long
        *,
        start_slot: int = 0,
        positions: torch.Tensor | None = None,  # [batch, n] long; default lengths[slot] + t
        tree_mask: torch.Tensor | None = None,  # [batch, n, m >= n] bool (kv_cache.attention_mask)
        logits_at: torch.Tensor | None = None,  # [batch, m] long: fed-token indices whose logits are wanted
        last_only: bool = False,  # logits of the last fed token only (prefill)
        want_hidden: bool = False,
        all_hidden: bool = False,  # hidden states of every fed token, whatever logits are kept (prefill for a head)
    ) -> RunnerOutput:
        start = time.perf_counter()
        token_ids = token_ids.to(self.device)
        batch, n = token_ids.shape
        lengths, longest = self._slots(start_slot, batch, n)
        # One small host-to-device copy per forward: the kept lengths are host ints (the loop branches on them).
        cache_lengths = torch.tensor(lengths, dtype=torch.long, device=self.device)  # [batch]
        write_index = cache_lengths.unsqueeze(1) + torch.arange(n, device=self.device)  # [batch, n]
        if positions is None:
            positions = write_index
        if self.max_position:
            positions = positions.clamp_max(self.max_position - 1)
        self.cache.step = StepLayout(start_slot, write_index, longest)
        mask = attention_mask(cache_lengths, n, longest, self.dtype, tree_mask)  # [batch, 1, n, kv_len]
        if last_only:
            keep: int | torch.Tensor = 1
        elif logits_at is not None:
            keep = logits_at.to(self.device)
        else:
            keep = 0
        out = self.model(
            input_ids=token_ids,
            position_ids=positions,
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,
            output_hidden_states=want_hidden or all_hidden,
        )
        for slot, length in enumerate(lengths, start_slot):
            self.cache.lengths[slot] = length + n
        hidden = None
        if want_hidden or all_hidden:
            hidden = out.hidden_states[-1]  # [batch, n, hidden]
            if last_only and not all_hidden:
                hidden = hidden[:, -1:]
            elif logits_at is not None and not all_hidden:
                hidden = hidden.gather(1, keep.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # honest timings for the adaptive controller
        self.last_forward_s = time.perf_counter() - start
        return RunnerOutput(out.logits, hidden)
