"""`NativeRunner`: the runner interface of `hf.HFRunner` on verispec's own models (`model/llama.py`: the Llama
family, optionally torch.compiled; `model/gemma.py`: Gemma 3, eager), picked by the config (`model_spec`). The engine cannot tell the two apart: same slots, same lengths, same masks.

Compilation (`compile=True`): the whole step (`llama.model_forward`: every layer and the LM head) is one compiled
program per shape class (`compile.py`: rows and fed tokens 1 or many, the attended length dynamic), cached on disk
under ~/.cache/verispec/compile so a later process loads rather than compiles. Off by default: with verispec's C++
kernels the compiled step measured slower than eager (docs/runner.md, "Compiled step"); CUDA graphs are not wired
in.
"""

from __future__ import annotations

import logging
import time

import torch

from ...config import MAX_VERIFY_WIDTH
from ..kernels import fused
from ..model.compile import cache_counts
from ..caches.kv_cache import SlotCache, attention_mask
from ..model.build import NativeModel
from ..model.gemma import GemmaSpec
from ..model.llama import LlamaSpec
from ..model.twins import release_hf_weights, twin
from .base import RunnerOutput, SlotRunner
from ..model.dtype import resolve_kv_cache_dtype

logger = logging.getLogger("verispec")

# A long forward runs as consecutive forwards of at most this many fed tokens (a prompt of 2,000 tokens as 8): the
# step's activations stay small (the MLP's [n, 2 x intermediate] alone is 147 MB at 2,048 tokens of the coder
# target, mapped fresh and page-faulted in by every layer), and a forward of any width is bit for bit the same
# tokens fed in pieces (the kernels are width-invariant), so only time and memory change: a 2,048-token prefill of
# the coder target 98 -> 107 tok/s (AMD EPYC, 2 threads, avx512_vnni; docs/runner.md "Long prompts").
PREFILL_PIECE = 256


def ring_entries(spec: LlamaSpec | GemmaSpec, max_len: int, sliding_ring: bool = True) -> int | None:
    """Entries a sliding-window layer keeps per slot: its window + MAX_VERIFY_WIDTH (the widest verify pass; a wider
    forward runs in pieces of that many tokens: `GemmaModel.forward`), or None where the model has no sliding layer,
    that is not fewer than max_len, or `sliding_ring` is off (`RunnerOptions.sliding_ring`: every entry kept)."""
    if not sliding_ring or not isinstance(spec, GemmaSpec) or not any(spec.sliding):
        return None
    ring = spec.sliding_window + MAX_VERIFY_WIDTH
    return ring if ring < max_len else None


def default_compile(hf_model) -> bool:
    """Whether to torch.compile by default: the measured choice per device (docs/runner.md, "Compiled step"): off
    on CPU, where the whole compiled step measured 0.72-0.95x eager (decode steps and verify passes, bf16 and fp32,
    verispec's C++ kernels on) and its first compile takes minutes; off on CUDA until measured there."""
    return False


class NativeRunner(SlotRunner):
    """`num_slots` sequences' KV caches of `max_len` entries on a native model (`LlamaModel`, `GemmaModel`); see
    hf.HFRunner."""

    backend = "native"

    def __init__(self, model: NativeModel, config, max_len: int, num_slots: int = 1, compile: bool = False,
                 batch_invariant: bool = False, kv_cache_dtype: str = "auto", sliding_ring: bool = True) -> None:
        self.model = model
        self.config = config
        self.spec = model.spec
        self.max_len = max_len
        self.num_slots = num_slots
        self.device = model.embed.device
        self.dtype = model.embed.dtype
        self.vocab_size = model.spec.vocab_size
        # the KV cache's entries (a 16-bit cache halves what attention reads; config.RunnerOptions.kv_cache_dtype)
        self.kv_dtype, self.kv_dtype_reason = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype, self.device,
                                                                     model.integer_activations())
        self.ring = ring_entries(model.spec, max_len, sliding_ring)  # sliding layers' entries per slot (None: every entry)
        rings = [self.ring if sliding else None for sliding in model.spec.sliding] if self.ring else None
        self.cache = SlotCache(model.spec.num_layers, num_slots, max_len, rings)
        if compile and model.quantized():
            logger.info("native runner: quantized weights run eager (the compiled step takes float weights; eager "
                        "with the C++ kernels is the faster path anyway: docs/runner.md)")
            compile = False
        if compile and not getattr(model, "compiles", True):
            logger.info("native runner: %s runs eager (it has no compiled step)", type(model).__name__)
            compile = False
        self.compiled = compile
        if compile:  # built before the first trace: Dynamo cannot trace the build (a graph break)
            fused.kernel()
        self.batch_invariant = batch_invariant  # attention in one fixed order (runtime/kernels/invariant.py)
        self.hf_model = None  # the Hugging Face model this twin was built from, if any
        self.compile_s = 0.0  # seconds spent in first calls of new shapes (compilation)
        self._shapes: set[tuple[int, int, bool]] = set()
        self.last_forward_s = 0.0

    @classmethod
    def from_hf(cls, hf_model, max_len: int, num_slots: int = 1, compile: bool = False,
                batch_invariant: bool = False, kv_cache_dtype: str = "auto", sliding_ring: bool = True) -> NativeRunner:
        """The native twin of a loaded Hugging Face model of a native family (UnsupportedModel if it is not). The
        twin is built once per model and shared by every runner on it (engines, drafters, benchmark methods)."""
        runner = cls(twin(hf_model, max_len, batch_invariant), hf_model.config, max_len, num_slots, compile,
                     batch_invariant, kv_cache_dtype, sliding_ring)
        runner.hf_model = hf_model  # the source, for release_hf_weights
        return runner

    def _buffers(self, end: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's key and value buffers, covering at least slots [0, end) (allocated / grown on demand)."""
        s = self.spec
        proto = torch.empty(0, s.num_kv_heads, 0, s.head_dim, dtype=self.kv_dtype, device=self.device)
        for layer in self.cache.layers:
            if not layer.is_initialized:
                layer.lazy_initialization(proto, proto)
            if layer.keys.shape[0] < end:
                layer._grow(end)
        return [layer.keys for layer in self.cache.layers], [layer.values for layer in self.cache.layers]

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [batch, n] long
        *,
        start_slot: int = 0,
        positions: torch.Tensor | None = None,  # [batch, n] long
        tree_mask: torch.Tensor | None = None,  # [batch, n, m >= n] bool (kv_cache.attention_mask)
        logits_at: torch.Tensor | None = None,  # [batch, m] long
        last_only: bool = False,
        want_hidden: bool = False,
        all_hidden: bool = False,
    ) -> RunnerOutput:
        batch, n = token_ids.shape
        if (n > PREFILL_PIECE and not self.compiled and not self.ring and positions is None and tree_mask is None
                and logits_at is None and not (want_hidden or all_hidden)):
            return self._in_pieces(token_ids, start_slot, last_only)
        start = time.perf_counter()
        token_ids = token_ids.to(self.device)
        lengths, longest = self._slots(start_slot, batch, n)
        keys, values = self._buffers(start_slot + batch)
        cache_lengths = torch.tensor(lengths, dtype=torch.long, device=self.device)  # [batch]
        write_index = cache_lengths.unsqueeze(1) + torch.arange(n, device=self.device)  # [batch, n]
        positions = write_index if positions is None else positions.to(self.device)
        tree_mask = None if tree_mask is None else tree_mask.to(self.device)
        mask = attention_mask(cache_lengths, n, longest, self.dtype, tree_mask)  # [batch, 1, n, kv_len]
        if last_only:
            select = torch.full((batch, 1), n - 1, dtype=torch.long, device=self.device)  # [batch, 1]
        elif logits_at is not None:
            select = logits_at.to(self.device)  # [batch, m]
        else:
            select = None
        # One program per class of (rows, fed tokens, logits wanted), its "many" sizes and the attended length
        # dynamic (compile.py). The first call of a class in a process loads it from disk or compiles it.
        shape = (min(batch, 2), min(n, 2), 0 if select is None else min(select.shape[1], 2))
        first = self.compiled and shape not in self._shapes
        if first:
            what = f"{'1' if batch == 1 else 'many'} row(s) x {'1' if n == 1 else 'many'} token(s)"
            self._shapes.add(shape)
            logger.info("native step for %s: loading its compiled program, or compiling it (once per shape class)",
                        what)
            before = cache_counts()
        compiled = (shape, dynamic_dims(batch, n, select)) if self.compiled else None
        if start_slot or keys[0].shape[0] != batch or self.compiled:  # (else the buffers are the batch's rows: no
            rows = slice(start_slot, start_slot + batch)  # 60 views to make; a program's inputs are views every call)
            keys, values = [k[rows] for k in keys], [v[rows] for v in values]
        if self.compiled:  # the same kind of tensors every call (a program's guards check views and strides)
            token_ids, positions, write_index, mask = (t.clone(memory_format=torch.contiguous_format) for t in (
                token_ids, positions, write_index, mask))
            select = None if select is None else select.clone(memory_format=torch.contiguous_format)
        ring = {"ring": self.ring} if self.ring else {}  # (GemmaModel's: the sliding layers' ring)
        logits, hidden = self.model(token_ids, positions, write_index, mask, keys, values, select,
                                    compiled=compiled, all_hidden=all_hidden, invariant=self.batch_invariant, **ring)
        for slot, length in enumerate(lengths, start_slot):
            self.cache.lengths[slot] = length + n
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_s = time.perf_counter() - start
        if first:
            self.compile_s += self.last_forward_s
            after = cache_counts()
            logger.info("native step for %s ready in %.1f s (programs: %d loaded from disk, %d compiled)", what,
                        self.last_forward_s, after["programs_loaded"] - before["programs_loaded"],
                        after["programs_compiled"] - before["programs_compiled"])
        return RunnerOutput(logits, hidden if want_hidden or all_hidden else None)

    def _in_pieces(self, token_ids: torch.Tensor, start_slot: int, last_only: bool) -> RunnerOutput:
        """forward of [batch, n] fed tokens as consecutive forwards of PREFILL_PIECE tokens (the same bits): the last
        position's logits (last_only), else every position's."""
        start, pieces = time.perf_counter(), []
        n = token_ids.shape[1]
        for begin in range(0, n, PREFILL_PIECE):
            end = min(n, begin + PREFILL_PIECE)
            out = self.forward(token_ids[:, begin:end], start_slot=start_slot, last_only=last_only)
            if not last_only or end == n:
                pieces.append(out.logits)
        self.last_forward_s = time.perf_counter() - start
        return RunnerOutput(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1), None)


def dynamic_dims(batch: int, n: int, select: torch.Tensor | None) -> dict[str, tuple[int, ...]]:
    """model_forward's argument dims a compiled program leaves dynamic (by argument name): the rows where many, the
    fed tokens where many, the attended length, the logits wanted where many."""
    rows, fed = ((0,) if batch > 1 else ()), ((1,) if n > 1 else ())
    dims = {name: rows + fed for name in ("token_ids", "positions", "write_index")}
    dims["mask"] = rows + ((2,) if n > 1 else ()) + (3,)  # [b, 1, n, L]
    dims["keys"] = dims["values"] = rows
    if select is not None:
        dims["select"] = rows + ((1,) if select.shape[1] > 1 else ())
    return {name: d for name, d in dims.items() if d}


def release_engine_weights(engine) -> int:
    """release_hf_weights for the target and every model drafter of an engine that run natively; -> bytes freed."""
    drafters = getattr(engine.drafter, "stages", [engine.drafter])
    if isinstance(engine.target, NativeRunner):  # a draft head reads the target's embeddings: the twin's from now on
        for drafter in drafters:
            if hasattr(drafter, "rebind_embeddings"):
                drafter.rebind_embeddings(engine.target.model.embed)
    runners = [engine.target] + [d.runner for d in drafters if hasattr(d, "runner")]
    return sum(release_hf_weights(r.hf_model) for r in runners if getattr(r, "hf_model", None) is not None)

