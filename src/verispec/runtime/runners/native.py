"""`NativeRunner`: the runner interface of `runner.HFRunner` on verispec's own models (`model/llama.py`: the Llama
family, optionally torch.compiled; `model/gemma.py`: Gemma 3, eager), picked by the config (`model_spec`). The engine cannot tell the two apart: same slots, same lengths, same masks.

Compilation (`compile=True`): the whole step (`llama.model_forward`: every layer and the LM head) is one compiled
program per shape class (`compile.py`: rows and fed tokens 1 or many, the attended length dynamic), cached on disk
under ~/.cache/verispec/compile so a later process loads rather than compiles. Off by default: with verispec's C++
kernels the compiled step measured slower than eager (docs/runner.md, "Compiled step"); CUDA graphs are not wired
in.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import weakref
from pathlib import Path

import torch

from ...config import MAX_VERIFY_WIDTH
from ..kernels import fused
from .compile import cache_counts
from ..caches.kv_cache import SlotCache, attention_mask
from ..model.gemma import ARCHITECTURES as GEMMA, GemmaModel, GemmaSpec, rope_tables
from ..model.llama import LlamaModel, LlamaSpec, UnsupportedModel
from .base import RunnerOutput, SlotRunner
from .dtype import resolve_kv_cache_dtype

logger = logging.getLogger("verispec")

_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF model -> (its native model, weights fingerprint)
NativeModel = LlamaModel | GemmaModel
# Sliding-window layers keep a ring of their latest entries (kv_cache.py); "off" keeps every entry (side-by-side runs)
SLIDING_RING = os.environ.get("VERISPEC_SLIDING_RING", "on").lower() != "off"


def ring_entries(spec: LlamaSpec | GemmaSpec, max_len: int) -> int | None:
    """Entries a sliding-window layer keeps per slot: its window + MAX_VERIFY_WIDTH (the widest verify pass; a wider
    forward runs in pieces of that many tokens: `GemmaModel.forward`), or None where the model has no sliding layer,
    that is not fewer than max_len, or SLIDING_RING is off."""
    if not SLIDING_RING or not isinstance(spec, GemmaSpec) or not any(spec.sliding):
        return None
    ring = spec.sliding_window + MAX_VERIFY_WIDTH
    return ring if ring < max_len else None


def default_compile(hf_model) -> bool:
    """Whether to torch.compile by default: the measured choice per device (docs/runner.md, "Compiled step"): off
    on CPU, where the whole compiled step measured 0.72-0.95x eager (decode steps and verify passes, bf16 and fp32,
    verispec's C++ kernels on) and its first compile takes minutes; off on CUDA until measured there."""
    return False


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A Hugging Face causal LM's tensors by checkpoint name (the same names as its safetensors files)."""
    weights = {name: p.detach() for name, p in model.named_parameters()}
    if "lm_head.weight" not in weights:  # tied embeddings share one tensor
        weights["lm_head.weight"] = model.get_output_embeddings().weight.detach()
    return weights


def rope_table(model_or_config, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim] (float32, attention scaling applied) from the model's own rotary module; for a
    config alone, the default rope computed here as Hugging Face's rotary module computes it (the same operations,
    so the same bits; tested), other rope types by that module."""
    rotary = getattr(getattr(model_or_config, "model", None), "rotary_emb", None)
    if rotary is None:
        config = getattr(model_or_config, "config", model_or_config).get_text_config()
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
            return _default_rope(config, rope["rope_theta"], max_len)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rotary = LlamaRotaryEmbedding(config)
    probe = torch.zeros(1, dtype=torch.float32, device=rotary.inv_freq.device)
    cos, sin = rotary(probe, torch.arange(max_len, device=probe.device).unsqueeze(0))
    return cos[0].float(), sin[0].float()


def _default_rope(config, base: float, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The original rotary embedding: inverse frequencies base^(-2i/d), angles position x frequency, each once per
    half of the head (Hugging Face's default rope type, operation for operation)."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [d / 2]
    freqs = torch.arange(max_len)[:, None].float() * inv_freq  # [max_len, d / 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [max_len, d]
    return angles.cos(), angles.sin()


def model_spec(config, max_len: int) -> LlamaSpec | GemmaSpec:
    """The native spec of a config (Gemma 3 or the Llama family), or UnsupportedModel saying why it has none."""
    if getattr(config.get_text_config(), "model_type", None) in GEMMA:
        return GemmaSpec.from_config(config, max_len)
    return LlamaSpec.from_config(config, max_len)


def table_positions(spec: LlamaSpec | GemmaSpec, config, max_len: int) -> int:
    """How many positions a new native model's rotary tables cover: a Llama-family model's the whole context (its
    tables are fixed once built), a Gemma model's `max_len` (it has four tables, 134 MB at Gemma 3's 32k context
    in fp32; `GemmaModel.reserve_positions` grows them where a runner needs more)."""
    if isinstance(spec, GemmaSpec):
        return max_len
    return max(max_len, getattr(config.get_text_config(), "max_position_embeddings", 0) or 0)


def build_model(spec: LlamaSpec | GemmaSpec, weights: dict[str, torch.Tensor], model_or_config, positions: int,
                pack: bool = True, invariant: bool = False) -> NativeModel:
    """The native model of `spec` on weights (by Hugging Face name), its rotary tables `positions` long."""
    if isinstance(spec, GemmaSpec):
        return GemmaModel(spec, weights, rope_tables(spec, positions), pack=pack, invariant=invariant)
    return LlamaModel(spec, weights, rope_table(model_or_config, positions), pack=pack, invariant=invariant)


def load_safetensors(folder: str | Path, dtype: torch.dtype, max_len: int, device: str = "cpu",
                     pack: bool = True) -> NativeModel:
    """Build the native model straight from a Hugging Face folder (config.json + *.safetensors), no HF modeling."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    spec = model_spec(config, max_len)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update({k: v.to(device=device, dtype=dtype) for k, v in load_file(file).items()})
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return build_model(spec, weights, config, max_len, pack=pack)


def _twin(hf_model, max_len: int, invariant: bool = False) -> NativeModel:
    """The shared native copy of hf_model's weights. A copy: rebuilt when the HF weights were replaced or changed
    in place (training) since, or built for the other `invariant` layout, unless they were released to it (then it
    is the only copy left)."""
    spec = model_spec(hf_model.config, max_len)
    if getattr(hf_model, "_verispec_released", False):
        model = _TWINS[hf_model][0]
        if model.invariant != invariant and model.lm_head.packed is True:  # (oneDNN's layout; others: one for both)
            raise ValueError(f"this model's weights were released to a native model with batch_invariant="
                             f"{model.invariant}: build every runner on it with the same batch_invariant")
        if model.cos.shape[0] < max_len and isinstance(model, GemmaModel):
            model.reserve_positions(max_len)
        if model.cos.shape[0] < max_len:
            raise ValueError(f"max_len {max_len} exceeds the native model's rotary table ({model.cos.shape[0]})")
        return model
    fingerprint = _fingerprint(hf_model)
    model, seen = _TWINS.get(hf_model, (None, None))
    other_layout = model is not None and model.invariant != invariant and model.lm_head.packed is True
    if model is None or seen != fingerprint or model.cos.shape[0] < max_len or other_layout:
        positions = table_positions(spec, hf_model.config, max_len)
        model = build_model(spec, weights_of(hf_model), hf_model, positions, invariant=invariant)
        _TWINS[hf_model] = (model, fingerprint)
    return model


def _fingerprint(hf_model) -> tuple:
    """Where hf_model's weights are and their versions: a twin built from them is stale once this changes."""
    return tuple((p.data_ptr(), p._version) for p in hf_model.parameters())


def native_twin_of(hf_model) -> NativeModel | None:
    """The native model already built for hf_model (shared by its native runners), or None when none was built."""
    entry = _TWINS.get(hf_model)
    return None if entry is None else entry[0]


def model_device(hf_model) -> torch.device:
    """Where hf_model's weights are: its native twin's device once they were released to it (HF's copies are then
    meta tensors), else its parameters'."""
    twin = native_twin_of(hf_model) if getattr(hf_model, "_verispec_released", False) else None
    return twin.cos.device if twin is not None else next(hf_model.parameters()).device


class NativeRunner(SlotRunner):
    """`num_slots` sequences' KV caches of `max_len` entries on a native model (`LlamaModel`, `GemmaModel`); see
    runner.HFRunner."""

    backend = "native"

    def __init__(self, model: NativeModel, config, max_len: int, num_slots: int = 1, compile: bool = False,
                 batch_invariant: bool = False, kv_cache_dtype: str = "auto") -> None:
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
        self.ring = ring_entries(model.spec, max_len)  # sliding layers' entries per slot (None: every entry)
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
                batch_invariant: bool = False, kv_cache_dtype: str = "auto") -> NativeRunner:
        """The native twin of a loaded Hugging Face model of a native family (UnsupportedModel if it is not). The
        twin is built once per model and shared by every runner on it (engines, drafters, benchmark methods)."""
        runner = cls(_twin(hf_model, max_len, batch_invariant), hf_model.config, max_len, num_slots, compile,
                     batch_invariant, kv_cache_dtype)
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
        start = time.perf_counter()
        token_ids = token_ids.to(self.device)
        batch, n = token_ids.shape
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


def use_quantized_weights(hf_model, max_len: int, gguf_file: str | Path | None = None,
                          quantization: str | None = None, release: bool = True,
                          activations: str = "fp32") -> NativeModel:
    """hf_model's native twin on quantized weights (runtime/kernels/quant.py), and HF's own copies released: the GGUF file's
    weights as stored (`--weights gguf`: the same values as the fp32 conversion hf_model was loaded from), or the
    twin's linears quantized (`--quantization int8`: a different model than the original). -> the twin.
    Afterwards hf_model holds no weights (meta tensors of the same shapes): only native runners run it. With
    release=False HF keeps its float weights (a draft model that HF's own assisted generation may also run).
    activations: what GGUF blocks compute with (quant.py: 'fp32', or 'q8' integer activations)."""
    from ..model.gguf_weights import read_gguf_weights
    from ..kernels.quant import quantize_linears

    spec = model_spec(hf_model.config, max_len)
    positions = table_positions(spec, hf_model.config, max_len)
    if gguf_file is not None:  # hf_model is this file's fp32 conversion: the same config
        weights = read_gguf_weights(gguf_file, spec.num_heads, spec.num_kv_heads, activations)
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])  # tied: the embedding's blocks
    else:
        weights = quantize_linears(weights_of(hf_model), quantization, activations)
    model = build_model(spec, weights, hf_model, positions, pack=False)
    if not release:
        _TWINS[hf_model] = (model, _fingerprint(hf_model))
        return model
    # HF's copies go (the twin is now the model), their shapes stay: vocabulary checks read them.
    for module in hf_model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.detach().to("meta"), requires_grad=False))
    adopt(hf_model, model)
    gc.collect()
    return model


def adopt(hf_model, model: NativeModel) -> None:
    """Make `model` the native twin and only copy of `hf_model`'s weights (which are meta tensors, or were released):
    every runner built on hf_model runs `model`, none runs Hugging Face modeling."""
    _TWINS[hf_model] = (model, None)
    hf_model._verispec_released = True
    hf_model._verispec_weight_bytes = sum(  # what a step reads: quantized blocks as stored, the rest as held
        w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()
        for w in {id(w): w for w in _model_weights(model)}.values())


def _model_weights(model: NativeModel) -> list:
    weights = [model.embed, model.norm, model.lm_head.weight]
    for layer in model.layers:
        weights += [w for w in layer.weights() if w is not None]
    return weights


def release_hf_weights(hf_model) -> int:
    """Free the Hugging Face copies of the weights the native twin holds in its own form (fused, packed, or copied:
    the twin aliases nothing), so a served model takes about its weights' size once, not twice; -> bytes freed.
    Afterwards only native runners can run this model object (make_runner with backend "hf" raises). Call it once
    every runner is built."""
    if hf_model not in _TWINS or getattr(hf_model, "_verispec_released", False):
        return 0
    freed, seen = 0, set()
    for module in hf_model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.numel():
                if param.data_ptr() not in seen:  # tied weights count once
                    seen.add(param.data_ptr())
                    freed += param.numel() * param.element_size()
                setattr(module, name, torch.nn.Parameter(param.new_empty(0), requires_grad=False))
    hf_model._verispec_released = True
    gc.collect()  # the last reference to a memory-mapped checkpoint goes: its pages leave the process
    return freed


def release_engine_weights(engine) -> int:
    """release_hf_weights for the target and every model drafter of an engine that run natively; -> bytes freed."""
    drafters = getattr(engine.drafter, "stages", [engine.drafter])
    if isinstance(engine.target, NativeRunner):  # a draft head reads the target's embeddings: the twin's from now on
        for drafter in drafters:
            if hasattr(drafter, "rebind_embeddings"):
                drafter.rebind_embeddings(engine.target.model.embed)
    runners = [engine.target] + [d.runner for d in drafters if hasattr(d, "runner")]
    return sum(release_hf_weights(r.hf_model) for r in runners if getattr(r, "hf_model", None) is not None)

