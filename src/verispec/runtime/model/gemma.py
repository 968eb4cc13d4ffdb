"""verispec's own Gemma 3 text model for the native runner (`runners/native.py`), beside `llama.py`.

What differs from the Llama family, each in one place here:
- four RMSNorms a layer (input, post-attention, pre-feedforward, post-feedforward: the attention's and the MLP's
  outputs are normed before they join the residual), and RMSNorms on q and k per head, before the rotary embedding;
  Gemma's norms scale by (1 + w): the weights are held as (1 + w), computed once in float32 as Hugging Face does,
  so `llama.rms_norm` (the C++ kernel where it runs) computes Gemma's norm; in fp32 the same operations as Hugging
  Face's (in bf16 the scale is rounded to bf16 first, as Llama's norm rounds);
- the MLP is GeGLU: gelu_tanh(gate) * up;
- the embedding is scaled by sqrt(hidden), rounded to the embedding's dtype (as Hugging Face rounds it); the LM
  head is tied to the embedding; an optional final logit soft-cap (tanh);
- attention scales scores by query_pre_attn_scalar^-1/2, not head_dim^-1/2: the kernels' 1/sqrt(d) is kept and
  the factor sqrt(d / query_pre_attn_scalar) is folded into the q norm's weight (exactly 1 for Gemma 3 270M, whose
  scalar is its head dim);
- layers alternate sliding-window (local) and global attention (`config.layer_types`), each kind with its own
  rotary base. Sliding layers see the `sliding_window` entries up to and including the query's position (Hugging
  Face's `kv_idx > q_idx - window`): the runner's mask with the entries further back hidden, made once a step.
  Where the runner gives `ring` (`NativeRunner.ring`: window + MAX_VERIFY_WIDTH entries, fewer than max_len), a
  sliding layer's cache is a ring (caches/kv_cache.py: cache index i at ring index i mod ring): its tokens are
  written at their ring indices and its mask is gathered onto the ring (`kv_cache.ring_mask`); a forward feeding
  more than ring - window tokens a row (a long prefill) runs its layers in pieces of that many (the same bits as one
  forward: every op is per token), so no entry a query may see was overwritten. The same logits as a cache of
  every entry: bitwise until a ring wraps, then within float rounding (the window summed in ring order; tested in
  tests/runtime/test_gemma_ring.py). Global layers keep every entry; prefix caching is off on rings
  (caches/prefix_cache.py).

The linears, the rotary embedding with the cache writes and the attention are Llama's (`llama.Linear`,
`llama.attention`: quantized GGUF blocks incl. K-quants, verispec's dense kernel, the fused C++ attention), so a
row's output is the same alone or in a batch (row-invariant linears, the kernels' fixed order). The q/k norms and
gelu_tanh * up are one C++ op each (`fused.qk_norm`, `fused.gelu_mul`; the GELU is computed as g / (1 + exp(-2u)),
within a few ulps of torch's tanh form). The layers run in one C++ call where every linear is a QuantWeight or
dense-packed (`layer_loop.h`'s GemmaLoop: the same ops in the same order as `layer_parts`, so the same bits; tested
in tests/kernels/test_layer_loop.py), else in Python (`VERISPEC_LAYER_LOOP=python` forces that). No torch.compile
path (eager only).

Shapes: b = rows, n = tokens fed per row, H / Hk = query / KV heads, d = head dim, L = cache entries attended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..caches.kv_cache import entry_index, ring_mask
from ..kernels import fused, layer_loop
from .architectures import GLOBAL, SLIDING
from .llama import Linear, UnsupportedModel, attention, linear, onto_huge_pages, own, rms_norm

ARCHITECTURES = ("gemma3_text",)  # model_type of the text model (a GGUF file's "gemma3" is its text model)


@dataclass(frozen=True)
class GemmaSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    query_pre_attn_scalar: float  # attention scores are scaled by its inverse square root
    sliding_window: int  # entries a sliding layer's query sees, its own included
    sliding: tuple[bool, ...]  # per layer: sliding-window (local) attention, else global
    rope_theta: float  # the global layers' rotary base
    local_rope_theta: float  # the sliding layers' rotary base
    final_logit_softcapping: float | None  # logits = cap * tanh(logits / cap) where set

    @classmethod
    def from_config(cls, config, max_len: int) -> GemmaSpec:
        """The spec of a Gemma 3 text config, or UnsupportedModel saying why it is not one this module runs."""
        config = config.get_text_config()
        kind = getattr(config, "model_type", None)
        if kind not in ARCHITECTURES:
            raise UnsupportedModel(f"model_type {kind!r} is not Gemma 3 ({', '.join(ARCHITECTURES)})")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModel(f"hidden_activation {act!r} (the native Gemma MLP is tanh-GELU-gated)")
        if getattr(config, "attention_bias", False) or getattr(config, "attn_logit_softcapping", None):
            raise UnsupportedModel("attention biases or attention logit soft-capping")
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModel("bidirectional attention (an encoder, not a causal LM)")
        rope = getattr(config, "rope_parameters", None) or {}
        for kind_of_layer in (SLIDING, GLOBAL):
            params = rope.get(kind_of_layer) or {}
            if params.get("rope_type", "default") != "default" or "rope_theta" not in params:
                raise UnsupportedModel(f"rope of the {kind_of_layer} layers: {params} (the native model computes "
                                       "the default rope only)")
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=config.head_dim,
            rms_norm_eps=config.rms_norm_eps,
            query_pre_attn_scalar=float(config.query_pre_attn_scalar),
            sliding_window=int(config.sliding_window or max_len),
            sliding=tuple(t == SLIDING for t in config.layer_types[: config.num_hidden_layers]),
            rope_theta=float(rope[GLOBAL]["rope_theta"]),
            local_rope_theta=float(rope[SLIDING]["rope_theta"]),
            final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        )


def rope_tables(spec: GemmaSpec, max_len: int) -> dict[str, torch.Tensor]:
    """cos, sin [max_len, d] of the global and the sliding layers (float32): Hugging Face's default rope, operation
    for operation (inverse frequencies base^(-2i/d), angles position x frequency, each once per half of the head)."""
    tables = {}
    for name, base in (("", spec.rope_theta), ("local_", spec.local_rope_theta)):
        d = spec.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float) / d))  # [d / 2]
        angles = torch.arange(max_len)[:, None].float() * inv_freq  # [max_len, d / 2]
        angles = torch.cat((angles, angles), dim=-1)  # [max_len, d]
        tables[name + "cos"], tables[name + "sin"] = angles.cos(), angles.sin()
    return tables


def one_plus(weight: torch.Tensor, scale: float = 1.0) -> nn.Parameter:
    """A Gemma norm's effective scale (1 + w), in float32 as Hugging Face computes it, times `scale` where not 1,
    in the weight's dtype."""
    effective = 1.0 + weight.detach().float()
    if scale != 1.0:
        effective = effective * scale
    return nn.Parameter(effective.to(weight.dtype), requires_grad=False)


def add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm) [..., hidden]: one C++ call where the kernels run (the add rounded as torch's)."""
    if weight.dtype == x.dtype and fused.available(x):
        return fused.rms_norm(x, weight, eps, residual=residual)
    total = x + residual
    return total, rms_norm(total, weight, eps)


class GemmaBlock(nn.Module):
    """One decoder layer's weights (q/k/v and gate/up fused, the norms as 1 + w); `layer_parts` runs it."""

    def __init__(self, spec: GemmaSpec, weights: dict[str, torch.Tensor], pack: bool, invariant: bool = False) -> None:
        super().__init__()
        w = weights
        self.qkv = Linear(torch.cat([w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"]]), None, pack,
                          invariant)
        self.o = Linear(w["o_proj.weight"], None, pack, invariant)
        self.gate_up = Linear(torch.cat([w["gate_proj.weight"], w["up_proj.weight"]]), None, pack, invariant)
        self.down = Linear(w["down_proj.weight"], None, pack, invariant)
        self.input_norm = one_plus(w["input_layernorm.weight"])  # [hidden]
        self.post_attn_norm = one_plus(w["post_attention_layernorm.weight"])  # [hidden]
        self.pre_mlp_norm = one_plus(w["pre_feedforward_layernorm.weight"])  # [hidden]
        self.post_mlp_norm = one_plus(w["post_feedforward_layernorm.weight"])  # [hidden]
        self.q_norm = one_plus(w["q_norm.weight"], math.sqrt(spec.head_dim / spec.query_pre_attn_scalar))  # [d]
        self.k_norm = one_plus(w["k_norm.weight"])  # [d]
        self.packed = self.qkv.packed
        assert all(m.packed == self.packed for m in (self.o, self.gate_up, self.down))

    def weights(self) -> tuple[torch.Tensor, ...]:
        return (self.qkv.weight, self.o.weight, self.gate_up.weight, self.down.weight, self.input_norm,
                self.post_attn_norm, self.pre_mlp_norm, self.post_mlp_norm, self.q_norm, self.k_norm)


def layer_parts(
    x: torch.Tensor,  # [b, n, hidden]
    cos: torch.Tensor,  # [b, 1, n, d]: this layer kind's rotary table at the fed positions
    sin: torch.Tensor,  # [b, 1, n, d]
    keys: torch.Tensor,  # [b, Hk, max_len, d]: this layer's cache rows, written in place
    values: torch.Tensor,  # [b, Hk, max_len, d]
    write_index: torch.Tensor,  # [b, n] long cache indices, or [b * Hk * n] flat entries (torch path)
    mask: torch.Tensor,  # [b, 1, n, L] additive: this layer kind's (sliding or global)
    w: tuple[torch.Tensor, ...],  # GemmaBlock.weights()
    spec: GemmaSpec,
    packed: bool,
    invariant: bool = False,
    pending: torch.Tensor | None = None,  # [b, n, hidden]: the previous layer's normed MLP output, still to add to x
) -> tuple[torch.Tensor, torch.Tensor]:  # (x + normed attention, normed MLP output) [b, n, hidden]
    """One decoder layer, its output as two terms (their sum is the layer's output): the next layer's input norm
    adds them in one pass (`add_norm`). Where the kernels run (`fused.available`), the q/k norms and gelu_tanh * up
    are one C++ call each (`fused.qk_norm`, `fused.gelu_mul`: the ops the C++ layer loop calls, so both loops give
    the same bits); else torch's ops."""
    qkv_w, o_w, gate_up_w, down_w, input_norm, post_attn_norm, pre_mlp_norm, post_mlp_norm, q_norm, k_norm = w
    s = spec
    b, n, _ = x.shape
    eps = s.rms_norm_eps
    x, h = (x, rms_norm(x, input_norm, eps)) if pending is None else add_norm(pending, x, input_norm, eps)
    kernels = fused.available(x)
    qkv = linear(h, qkv_w, None, packed)  # [b, n, (H + 2 Hk) d]
    if kernels and q_norm.dtype == x.dtype:  # q and k normed per head in one call
        qkv = fused.qk_norm(qkv, q_norm, k_norm, s.num_heads, s.num_kv_heads, eps)
    else:
        q, k, v = qkv.split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim], -1)
        qkv = torch.cat([rms_norm(q.reshape(b, n, s.num_heads, s.head_dim), q_norm, eps).view(b, n, -1),
                         rms_norm(k.reshape(b, n, s.num_kv_heads, s.head_dim), k_norm, eps).view(b, n, -1),
                         v], dim=-1)
    attn = attention(qkv, cos, sin, keys, values, write_index, mask, s, invariant)  # [b, n, H d]
    x, h = add_norm(rms_norm(linear(attn, o_w, None, packed), post_attn_norm, eps), x, pre_mlp_norm, eps)
    gate_up = linear(h, gate_up_w, None, packed)  # [b, n, 2 I]
    if kernels:
        act = fused.gelu_mul(gate_up)  # [b, n, I]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") * up
    out = linear(act, down_w, None, packed)
    return x, rms_norm(out, post_mlp_norm, eps)


class GemmaModel(nn.Module):
    """The decoder and tied LM head. `forward` runs one step of the runner, as `llama.LlamaModel.forward` does."""

    compiles = False  # no torch.compile path: the runner runs it eager

    def __init__(self, spec: GemmaSpec, weights: dict[str, torch.Tensor], rope: dict[str, torch.Tensor],
                 pack: bool = True, invariant: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.invariant = invariant
        self.embed = own(weights["model.embed_tokens.weight"])  # [vocab, hidden]
        dtype = self.embed.dtype if isinstance(self.embed, torch.Tensor) else torch.float32
        # sqrt(hidden) rounded to the embedding's dtype, as Hugging Face multiplies it (a QuantWeight's rows: fp32)
        self.embed_scale = nn.Buffer(torch.tensor(spec.hidden_size ** 0.5).to(dtype), persistent=False)
        self.layers = nn.ModuleList(
            GemmaBlock(spec, {".".join(k.split(".")[-2:]): v for k, v in weights.items()  # "q_proj.weight", ...
                              if k.startswith(f"model.layers.{i}.")}, pack, invariant)
            for i in range(spec.num_layers)
        )
        self.norm = one_plus(weights["model.norm.weight"])  # [hidden]
        self.lm_head = Linear(weights.get("lm_head.weight", self.embed), None, pack, invariant)
        for name, table in rope.items():  # cos, sin (global layers), local_cos, local_sin: [max_len, d]
            setattr(self, name, nn.Buffer(table, persistent=False))
        assert all(layer.packed == self.lm_head.packed for layer in self.layers)
        onto_huge_pages(self.linears())
        self._loop: list = []  # layer_loop.build_gemma's, made on the first forward (the weights are final then)
        self._layer_weights: list = []  # every GemmaBlock.weights(), gathered once (nn.Module access costs per call)

    def layer_loop(self) -> layer_loop.Loop | None:
        """The C++ loop over this model's layers (`layer_loop.py`'s GemmaLoop), or None where it does not serve."""
        if not self._loop:
            self._loop.append(layer_loop.build_gemma(self.layer_weights(), self.lm_head.packed, self.spec))
        return self._loop[0]

    def layer_weights(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Every layer's `GemmaBlock.weights()` (fixed once built)."""
        if not self._layer_weights:
            self._layer_weights.append(tuple(layer.weights() for layer in self.layers))
        return self._layer_weights[0]

    def reserve_positions(self, positions: int) -> None:
        """Rotary tables covering `positions` (the runner's max_len) at least: made anew where shorter (each entry is
        computed on its own, so the entries already there keep their values)."""
        if self.cos.shape[0] < positions:
            for name, table in rope_tables(self.spec, positions).items():
                setattr(self, name, nn.Buffer(table.to(self.cos.device), persistent=False))

    def linears(self) -> list[Linear]:
        """Every linear, in the order a step runs them: each layer's qkv, o, gate_up, down, then the LM head."""
        return [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def quantized(self) -> bool:
        """Whether any linear holds quantized blocks (runtime/kernels/quant.py)."""
        return any(not isinstance(m.weight, (torch.Tensor, tuple)) for m in self.linears())

    def integer_activations(self) -> bool:
        """Whether any linear computes with integer activations (`--activations q8`)."""
        return any(getattr(m.weight, "activations", None) == "q8" for m in self.linears())

    def forward(
        self,
        token_ids: torch.Tensor,  # [b, n] long
        positions: torch.Tensor,  # [b, n] long: rotary positions
        write_index: torch.Tensor,  # [b, n] long: cache index of each fed token
        mask: torch.Tensor,  # [b, 1, n, L] additive
        keys: list[torch.Tensor],  # per layer [b, Hk, max_len, d] (a sliding layer's [b, Hk, ring, d] with `ring`)
        values: list[torch.Tensor],  # per layer, as keys
        select: torch.Tensor | None = None,  # [b, m] long: fed-token indices whose logits are wanted (None: all)
        compiled: tuple | None = None,  # never set: the runner runs this model eager (`compiles`)
        all_hidden: bool = False,  # hidden of all n fed tokens, not only the selected ones
        invariant: bool = False,  # batch- and width-invariant attention (invariant.py)
        ring: int | None = None,  # the sliding layers' entries per slot where they keep a ring (kv_cache.py)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [b, m, vocab], hidden [b, m or n, hidden]
        assert compiled is None
        s = self.spec
        x = F.embedding(token_ids, self.embed)  # [b, n, hidden]
        x = x * self.embed_scale.to(x.dtype)
        tables = {False: (self.cos, self.sin), True: (self.local_cos, self.local_sin)}
        rope = {kind: (c[positions].unsqueeze(1).to(x.dtype), si[positions].unsqueeze(1).to(x.dtype))
                for kind, (c, si) in tables.items() if kind in s.sliding}  # [b, 1, n, d] each
        # a sliding layer's query at position p also hides the entries at p - window and before (a kept prefix's
        # entry i holds position i; fed tokens, even a tree's, are within the window of each other)
        far = torch.arange(mask.shape[-1], device=mask.device) <= (positions.unsqueeze(-1) - s.sliding_window)
        masks = {False: mask, True: mask.masked_fill(far.unsqueeze(1), torch.finfo(mask.dtype).min)}
        if ring is None:
            x, out = self._layers(x, rope, {False: write_index, True: write_index}, keys, values, masks, invariant)
        else:  # the sliding layers' rings: pieces of at most ring - window tokens a row (kv_cache.py's invariant)
            piece, parts = max(1, ring - s.sliding_window), []
            for start in range(0, x.shape[1], piece):
                cut = slice(start, start + piece)
                index = write_index[:, cut]  # [b, piece]
                ends = index[:, -1] + 1  # [b]: each row's written length after this piece
                parts.append(self._layers(
                    x[:, cut], {kind: (c[:, :, cut], si[:, :, cut]) for kind, (c, si) in rope.items()},
                    {False: index, True: index % ring}, keys, values,
                    {False: mask[:, :, cut], True: ring_mask(masks[True][:, :, cut], ends, ring)}, invariant))
            x, out = parts[0] if len(parts) == 1 else (torch.cat(terms, dim=1) for terms in zip(*parts))
        x = x + out
        if all_hidden:  # normed once, at every position; the selected rows are gathered from it (the norm is per row)
            every = rms_norm(x, self.norm, s.rms_norm_eps)  # [b, n, hidden]
            hidden = every if select is None else every.gather(1, select.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
            return self._logits(hidden), every
        if select is not None:
            x = x.gather(1, select.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # [b, m, hidden]
        hidden = rms_norm(x, self.norm, s.rms_norm_eps)
        return self._logits(hidden), hidden

    def _layers(
        self,
        x: torch.Tensor,  # [b, n, hidden]
        rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],  # sliding -> (cos, sin) [b, 1, n, d]
        index: dict[bool, torch.Tensor],  # sliding -> [b, n] long: where each fed token is written in such a layer
        keys: list[torch.Tensor],  # per layer [b, Hk, max_len or ring, d]
        values: list[torch.Tensor],
        masks: dict[bool, torch.Tensor],  # sliding -> [b, 1, n, L] additive, over that layer's entries
        invariant: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x + normed attention, normed MLP output) of the last layer
        """Every layer: in one C++ call where the loop serves (the same bits), else `layer_parts` one by one."""
        s = self.spec
        if not fused.available(x):  # torch's path: the flat entries of each kind's buffers, once a step
            index = {kind: entry_index(i, s.num_kv_heads, keys[s.sliding.index(kind)].shape[2])
                     for kind, i in index.items() if kind in s.sliding}
        loop = self.layer_loop()
        if layer_loop.serves(loop, x, next(iter(index.values())), invariant):
            return layer_loop.run_gemma(loop, x, rope, index, keys, values, masks)
        out = None  # [b, n, hidden]: the last layer's normed MLP output, added to x by the next norm or the caller
        for w, sliding, k, v in zip(self.layer_weights(), s.sliding, keys, values):
            x, out = layer_parts(x, *rope[sliding], k, v, index[sliding], masks[sliding], w, s,
                                 self.lm_head.packed, invariant, out)
        return x, out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [b, m, hidden] -> [b, m, vocab]
        logits = self.lm_head(hidden)
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
