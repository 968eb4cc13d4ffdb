"""The target's own quantized twin as a drafter (`--draft-model self:int8`, `self:int4`, ...): no training, no
second model to ship.

The twin is a draft model whose weights come from the target: every linear of every layer and the LM head
weight-only quantized (runtime/kernels/quant.py: per-output-channel int8, or GGUF blocks of 32), run on verispec's native
model of the target's family (runtime/model/llama.py, gemma.py) with its own slot KV cache. Everything else is `ModelDrafter`'s: chains,
batched rows, the prefix cache, and q (its processed probabilities), so rejection sampling stays exact whatever the
quantization did to the distribution.

Shared with the target, not copied: the token embedding (the target's native model's, or its Hugging Face tensor
where the target runs on Hugging Face modeling) and the rotary tables. Its own: the quantized linears (int8 ~1.0
byte per weight, Q4_1 0.625, Q4_0 0.56, Q8_0 1.06), the norms, and its KV cache (the target's size per slot).

Formats (`self:FORMAT`): int8 (per channel), int4 (Q4_1: Q4_0 was measured lower acceptance at the same cost,
docs/speculation.md), q4_0, q4_1, q8_0. `self:FORMAT:vN` reduces the LM head to the first N token ids (and the
end-of-sequence ids): fewer bytes per draft token, q a distribution over that subset (twin_head.py). The twin quantizes the target's weights as loaded, so it needs them: a
target already on quantized weights (--weights gguf, --quantization int8) or whose weights were released to its
native runner has none left to quantize (ValueError).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import RunnerOptions
from ..runtime.model.memory import twin_bytes
from ..runtime.model.llama import LlamaModel, UnsupportedModel
from ..runtime.runners.native import NativeRunner
from ..runtime.model.build import NativeModel, build_model, model_spec, table_positions, weights_of
from ..runtime.model.twins import is_released, native_twin_of
from ..runtime.kernels.quant import BLOCK, quantize_linears
from .model import ModelDrafter
from .twin_head import reduce_head

TWIN_PREFIX = "self:"
# self:FORMAT -> the quantization of runtime/kernels/quant.py (`quantize_linears`' qtype)
TWIN_FORMATS = {"int8": "int8", "int4": "Q4_1", "q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0"}
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
MIN_HEAD_TOKENS = 1


def is_twin(name: str) -> bool:
    """Whether a drafter value names the target's twin ('self:...')."""
    return name.startswith(TWIN_PREFIX)


def twin_qtype(name: str) -> str:
    """'self:int8' -> 'int8', 'self:int4' -> 'Q4_1'; ValueError naming the formats for any other 'self:' value."""
    return parse_twin(name)[0]


def parse_twin(name: str) -> tuple[str, int | None]:
    """'self:int8' -> ('int8', None); 'self:int4:v8192' -> ('Q4_1', 8192): the quantization and the reduced LM
    head's token count (None: the whole vocabulary). ValueError naming the choices for anything else."""
    fmt, _, head = name[len(TWIN_PREFIX):].strip().lower().partition(":")
    if fmt not in TWIN_FORMATS:
        raise ValueError(f"--draft-model {name!r}: unknown twin format {fmt!r}; choose from "
                         f"{', '.join(TWIN_PREFIX + f for f in TWIN_FORMATS)}")
    if not head:
        return TWIN_FORMATS[fmt], None
    if not (head.startswith("v") and head[1:].isdigit() and int(head[1:]) >= MIN_HEAD_TOKENS):
        raise ValueError(f"--draft-model {name!r}: the twin's reduced LM head is written ':vN' with N >= "
                         f"{MIN_HEAD_TOKENS} token ids, e.g. {TWIN_PREFIX}{fmt}:v8192, got {head!r}")
    return TWIN_FORMATS[fmt], int(head[1:])


def twin_memory_bytes(name: str, target_config, max_len: int, slots: int, dtype: torch.dtype) -> int:
    """Bytes the twin `name` adds beside its target, from the target's config (memory.twin_bytes): its quantized
    weights and its KV cache of `slots` slots of `max_len` entries; for the memory checks before building it."""
    qtype, head_tokens = parse_twin(name)
    try:
        return twin_bytes(target_config, qtype, head_tokens, max_len, slots, dtype)
    except UnsupportedModel as exc:
        raise _not_native(exc) from None


def twin_model(target, qtype: str, max_len: int, head_tokens: int | None = None) -> NativeModel:
    """The target's native model with its linears and LM head quantized to `qtype` (the head reduced to
    `head_tokens` token ids when given); the embedding and the rotary tables are the target's own tensors (no
    copy). ValueError when the target cannot have a twin."""
    if is_released(target):
        raise ValueError("the target's own weights are no longer loaded (it runs on quantized weights, --weights "
                         "gguf / --quantization, or they were released to its native runner): the twin "
                         "(--draft-model self:...) quantizes the float weights, so draft with another drafter or "
                         "load the target in float32 / bfloat16")
    config = target.config.get_text_config()
    try:
        spec = model_spec(config, max_len)
    except UnsupportedModel as exc:
        raise _not_native(exc) from None
    widths = {"hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
              "attention width": spec.num_heads * spec.head_dim}
    odd = [f"{name} {width} is not a multiple of {BLOCK}" for name, width in widths.items() if width % BLOCK]
    if odd:
        raise ValueError(f"the twin drafter quantizes in blocks of {BLOCK} inputs, and this target's "
                         f"{', '.join(odd)}: use a draft model or ngram")
    weights = weights_of(target)
    embed = weights[EMBED]  # [vocab, hidden]: shared (an untied LM head is quantized like any linear)
    keep = {k: v for k, v in weights.items() if k != EMBED and (head_tokens is None or k != HEAD)}
    quantized = quantize_linears(keep, qtype)
    if head_tokens is not None:
        quantized[HEAD] = reduce_head(weights[HEAD], head_tokens, _eos_ids(config),
                                      lambda rows: quantize_linears({HEAD: rows}, qtype)[HEAD])
    quantized[EMBED] = embed.to("meta")  # the model clones what it is given: a meta tensor costs nothing
    shared = native_twin_of(target)
    if isinstance(shared, LlamaModel) and shared.cos.shape[0] >= max_len:
        model = LlamaModel(spec, quantized, (shared.cos, shared.sin), pack=False)
    else:
        model = build_model(spec, quantized, target, table_positions(spec, config, max_len), pack=False)
    model.embed = _parameter(embed)
    return model


def _not_native(exc: UnsupportedModel) -> ValueError:
    return ValueError(f"the twin drafter (--draft-model self:...) runs on verispec's native models (the Llama "
                      f"family, Gemma 3), and this target is not one ({exc}): use a draft model or ngram")


def _eos_ids(config) -> list[int]:
    """The end-of-sequence ids of a model config (one id, a list, or none)."""
    eos = getattr(config, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    """The same storage as a parameter (nn.Parameter of a tensor aliases it)."""
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)


class TwinDrafter(ModelDrafter):
    """A ModelDrafter on the target's quantized twin (module docstring). It always runs natively: on a target run
    by Hugging Face modeling too (quantized weights need the native model)."""

    def __init__(self, target, name: str, max_len: int, num_slots: int = 1) -> None:
        self.target = target  # the Hugging Face model the twin came from: its embedding is shared
        self.name = name
        self.qtype, self.head_tokens = parse_twin(name)
        self.model = twin_model(target, self.qtype, max_len, self.head_tokens)
        self.max_len = max_len
        self.options: RunnerOptions | None = None
        self.runner = NativeRunner(self.model, target.config, max_len, num_slots)

    def reserve(self, num_slots: int, runner: RunnerOptions | None = None) -> None:
        self._share_target_tables()
        invariant = bool(runner and runner.batch_invariant)
        if invariant != self.runner.batch_invariant:
            # Quantized weights have one layout for both; only the attention order changes. Never compiled: the
            # quantized kernel is its own C++ op (runtime/kernels/quant.py).
            self.options = runner
            self.runner = NativeRunner(self.model, self.target.config, self.max_len, num_slots,
                                       batch_invariant=invariant)
        self.runner.reserve(num_slots)

    def rebind_embeddings(self, embed: torch.Tensor) -> None:
        """The target's embedding now lives in `embed` (native.release_engine_weights): share that one."""
        if embed.shape == self.model.embed.shape and embed.dtype == self.model.embed.dtype:
            self.model.embed = _parameter(embed)

    def _share_target_tables(self) -> None:
        """Once the engine has built the target's native model (its runner comes before any drafter's reserve),
        share its embedding and rotary tables instead of the Hugging Face tensors, which are freed when the HF
        weights are released (otherwise the twin would keep a second copy alive)."""
        shared = native_twin_of(self.target)
        if shared is None or not isinstance(shared.embed, torch.Tensor):
            return
        self.rebind_embeddings(shared.embed)
        if shared.cos.shape[0] >= self.model.cos.shape[0] and shared.cos.dtype == self.model.cos.dtype:
            self.model.cos, self.model.sin = shared.cos, shared.sin

    def weight_bytes(self) -> int:
        """Bytes the twin holds beyond the target's: its quantized linears and LM head, norms and biases."""
        own = [self.model.norm, self.model.lm_head.weight]
        for layer in self.model.layers:
            own += [w for w in layer.weights() if w is not None]
        return sum(w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size() for w in own)


def twin_drafter(target, name: str, cache_len: int) -> TwinDrafter:
    """The drafter `self:FORMAT` names for `target` (cache_len: KV entries per slot, build.py's)."""
    return TwinDrafter(target, name, cache_len)
