"""`ModelRunner`: one Hugging Face causal LM plus its `SlotCache`, behind the interface the engine talks to.

    forward(token_ids [batch, n], start_slot, positions, tree_mask, logits_at, want_hidden) -> RunnerOutput

Row b of a forward is the sequence in slot start_slot + b. Its n tokens are written after that slot's kept
entries (cache index lengths[slot] + t), at rotary/learned positions `positions` (default: the same indices;
a token tree passes depths instead), attending under a 4D mask built here (kv_cache.attention_mask). After the
forward every slot of the batch has grown by n; the engine then sets each slot's kept length (rollback and
padding are bookkeeping). A faster native runner implements the same methods without the engine changing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..config import RunnerOptions
from .dtype import choose_dtype, dtype_name
from .kv_cache import SlotCache, StepLayout, attention_mask

logger = logging.getLogger("verispec")


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [batch, m, vocab]: at the positions asked for (all n, or logits_at)
    hidden: torch.Tensor | None  # [batch, m, hidden]: the last hidden states there (want_hidden=True; all n fed
    # tokens with all_hidden=True), else None


class SlotRunner:
    """What every runner shares: `num_slots` sequences' KV caches (`self.cache`, a SlotCache) of `max_len` entries;
    rollback, compaction and reset are bookkeeping on the cache's per-slot lengths."""

    cache: SlotCache
    max_len: int
    num_slots: int

    @property
    def lengths(self) -> list[int]:
        """[slot]: entries kept per slot."""
        return self.cache.lengths

    @property
    def length(self) -> int:
        """Entries kept in slot 0 (the one-sequence case)."""
        return self.cache.lengths[0]

    def reserve(self, num_slots: int) -> None:
        """Room for up to num_slots sequences (buffers grow on first use of a slot, so this allocates nothing)."""
        self.cache.reserve(num_slots)
        self.num_slots = self.cache.num_slots

    def truncate(self, length: int, slot: int = 0) -> None:
        """Keep the first `length` entries of `slot` (rollback: never more than the slot holds after a forward)."""
        self.cache.set_length(slot, length)

    @torch.inference_mode()  # the buffers were made under inference mode: in-place writes must be too
    def move_slot(self, src: int, dst: int) -> None:
        self.cache.move(src, dst)

    @torch.inference_mode()
    def keep_path(self, slot: int, base: int, nodes: list[int]) -> None:
        """After a token tree was fed at cache indices base + node: keep the accepted path's entries (nodes, root
        first) at base, base + 1, ...; the slot then holds base + len(nodes) entries. The only copy rollback makes."""
        self.cache.keep_path(slot, base, nodes)

    def reset(self, slot: int | None = None) -> None:
        if slot is None:
            self.cache.reset()
        else:
            self.cache.set_length(slot, 0)

    def _slots(self, start_slot: int, batch: int, n: int) -> tuple[list[int], int]:
        """The kept lengths of slots [start_slot, start_slot + batch) and the longest row after n more tokens."""
        lengths = self.cache.lengths[start_slot : start_slot + batch]
        assert len(lengths) == batch, f"slots [{start_slot}, {start_slot + batch}) exceed {self.num_slots} slots"
        longest = max(lengths) + n
        if longest > self.max_len:
            raise ValueError(f"sequence of {longest} tokens exceeds the KV cache ({self.max_len}); raise max_len")
        return lengths, longest


class ModelRunner(SlotRunner):
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
        tree_mask: torch.Tensor | None = None,  # [batch, n, n] bool: which fed tokens each fed token sees
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


def runner_info(runner) -> dict:
    """What runs a model, for --json output and benchmark reports."""
    auto, why = choose_dtype(runner.device)
    info = {"backend": runner.backend, "compiled": runner.compiled, "compile_s": round(runner.compile_s, 2),
            "dtype": dtype_name(runner.dtype), "device": str(runner.device),
            "dtype_auto": dtype_name(auto), "dtype_auto_reason": why}
    if runner.backend == "native":
        info["packed_weights"] = runner.model.layers[0].packed
    return info


# The options of runners built without explicit ones (the test suite sets it to run everything on each runner).
DEFAULT_OPTIONS = RunnerOptions()


def make_runner(model: PreTrainedModel, max_len: int, num_slots: int = 1, options: RunnerOptions | None = None):
    """The runner for `model`: the native Llama-family runner where it applies (backend "auto" or "native"),
    Hugging Face modeling otherwise. backend="native" on a model outside the family is the caller's error."""
    from .native import NativeRunner, UnsupportedModel, default_compile

    options = options or DEFAULT_OPTIONS
    if options.backend == "hf" and getattr(model, "_verispec_released", False):
        raise ValueError("this model's Hugging Face weights were released to the native runner "
                         "(native.release_hf_weights): use the runner backend 'auto' or 'native', or load it again")
    if options.backend != "hf":
        try:
            compile = default_compile(model) if options.compile is None else options.compile
            return NativeRunner.from_hf(model, max_len, num_slots, compile=compile)
        except UnsupportedModel as exc:
            if options.backend == "native":
                raise ValueError(f"the native runner cannot run this model: {exc}; use the runner backend "
                                 f"'hf' or 'auto'") from exc
            logger.info("native runner not used (%s): Hugging Face modeling runs this model", exc)
    return ModelRunner(model, max_len, num_slots)
