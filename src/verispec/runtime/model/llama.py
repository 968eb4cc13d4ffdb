"""verispec's own Llama-family model: Llama, Qwen2, Mistral, SmolLM (RMSNorm, rotary attention with grouped KV
heads, gated SiLU MLP), in one readable module for the native runner (`native.py`).

Compared with Hugging Face modeling it has no per-call bookkeeping: q/k/v and gate/up are fused into one matrix
each, every linear goes through `Linear` (weights packed once for verispec's dense kernel, or oneDNN's: small
batches of rows then cost about what one row does), the rotary table is precomputed for every position, and the
KV cache is the runner's slot buffers, written in place at per-row indices.

Shapes: b = rows, n = tokens fed per row, H / Hk = query / KV heads, d = head dim, L = cache entries attended.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import dense, fused, layer_loop, quant
from ..weights import hugepages
from ..model.compile import run_program
from ..kernels.invariant import MAX_INVARIANT_IN, block_attention, split_in
from ..caches.kv_cache import entry_index, write_entries
from .architectures import UnsupportedModel
from .reduced_head import ReducedHead

# model_type -> (q/k/v carry a bias). Every other architecture runs on Hugging Face modeling.
ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": True}
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class LlamaSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool

    @classmethod
    def from_config(cls, config, max_len: int) -> LlamaSpec:
        """The spec of a Hugging Face config, or UnsupportedModel saying why it is not one of ours."""
        config = config.get_text_config()
        kind = getattr(config, "model_type", None)
        if kind not in ARCHITECTURES:
            raise UnsupportedModel(f"model_type {kind!r} is not in the native family ({', '.join(ARCHITECTURES)})")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {config.hidden_act!r} (the native MLP is SiLU-gated)")
        if getattr(config, "mlp_bias", False) or (kind != "qwen2" and getattr(config, "attention_bias", False)):
            raise UnsupportedModel("biases on the MLP or the attention output")
        window = getattr(config, "sliding_window", None)
        if window is not None and (kind != "qwen2" or getattr(config, "use_sliding_window", False)) and window < max_len:
            raise UnsupportedModel(f"sliding-window attention ({window} < max_len {max_len})")
        rope = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        if rope.get("rope_type", rope.get("type", "default")) not in STATIC_ROPE:
            raise UnsupportedModel(f"rope type {rope.get('rope_type')!r} varies with the sequence length")
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=ARCHITECTURES[kind],
        )


def try_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's pre-packed (blocked) layout of a [out, in] weight, or None where this CPU/dtype has no such path."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except RuntimeError:  # e.g. bf16 on a CPU without AVX-512 or AVX-NE-CONVERT
        return None
    return packed


@torch.library.custom_op("verispec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ packed weight -> [rows, out]. An opaque op to torch.compile: Inductor fuses everything
    around it and calls oneDNN here (its own lowering of the oneDNN op expects weights it packed itself)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


Weight = torch.Tensor | tuple[torch.Tensor, ...]  # one [out, in] (plain or packed), or packed input chunks
DENSE = "dense"  # `packed` value of a weight in verispec's own kernel's layout (runtime/kernels/dense.py)
Packing = bool | str  # False: plain (aten); True: oneDNN's packed layout; DENSE: verispec's dense kernel


class Linear(nn.Module):
    """y = x W^T (+ b). On CPU an fp32 or bf16 weight is packed once for verispec's own kernel (`dense.py`; then the
    packed copy is the only one kept): it streams the weight at close to the memory bandwidth at one row, 2..16
    rows cost little more than one (what makes verify passes and batches cheap; MKL's plain sgemm costs about M
    times a one-row pass), and it is row-invariant by construction (a row's output does not depend on how many
    rows run with it), so `invariant` needs nothing more of it.

    Where that kernel is not built (no compiler), oneDNN's packed layout serves: row-invariant up to
    `MAX_INVARIANT_IN` inputs, so with `invariant` (the runner's batch_invariant) a wider weight is kept as input
    chunks, summed in order; a bf16 weight this CPU cannot pack (no AVX-512-bf16 / AVX-NE-CONVERT) is kept as fp32
    (exact) and packed, its products rounded to bf16 once. Only an unpacked weight runs aten's GEMM, which is not
    row-invariant."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, invariant: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else own(bias)  # [out]
        if pack and dense.supports(weight):
            self.packed: Packing = DENSE
            self.weight: Weight = nn.Parameter(dense.pack(weight), requires_grad=False)  # [out, in (+1 for bf16)]
            return
        # A quantized weight (runtime/kernels/quant.py) is never packed: F.linear reaches its own kernel.
        quantized = not isinstance(weight, torch.Tensor)
        packed = try_pack(weight) if pack and not quantized else None
        if packed is None and pack and not quantized and weight.dtype == torch.bfloat16:
            packed = try_pack(weight.float())
        self.packed = packed is not None
        if self.packed and invariant and self.in_features > MAX_INVARIANT_IN:
            source = weight if packed.dtype == weight.dtype else weight.float()
            self.parts = nn.ParameterList([nn.Parameter(try_pack(part), requires_grad=False)
                                           for part in split_in(source)])  # [out, <= MAX_INVARIANT_IN] each
            self.weight = tuple(self.parts)
        else:
            self.weight = nn.Parameter(packed, requires_grad=False) if self.packed else own(weight)  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return linear(x, self.weight, self.bias, self.packed)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, packed: Packing) -> torch.Tensor:
    """x [..., in] -> [..., out] with a plain [out, in] or a packed weight (ours, oneDNN's, or oneDNN input chunks)."""
    if not packed:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if packed == DENSE:
        y = dense.linear(rows, weight, bias).to(x.dtype)  # [rows, out]
    elif isinstance(weight, tuple):  # input chunks, summed in chunk order in fp32
        y, start = None, 0
        for i, part in enumerate(weight):
            width = part.shape[1]
            term = _packed(rows[:, start : start + width].contiguous(), part, bias if i == 0 else None).float()
            y, start = term if y is None else y + term, start + width
        y = y.to(x.dtype)
    else:
        y = _packed(rows, weight, bias).to(x.dtype)
    return y.view(*x.shape[:-1], y.shape[-1])


def _packed(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [rows, in] @ a oneDNN-packed weight (in its dtype: a bf16 weight kept as fp32 takes fp32 rows)."""
    rows = rows.to(weight.dtype)
    if bias is not None:
        bias = bias.to(weight.dtype)
    if torch.compiler.is_compiling():
        return packed_linear(rows, weight, bias)  # [rows, out]
    # eager: the oneDNN op itself, without the custom op's dispatch (~50 us a call)
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


def own(tensor: torch.Tensor) -> nn.Parameter:
    """A copy the model owns: nothing it holds aliases the source's tensors (or the file those are mapped from),
    so the source can be freed (twins.release_hf_weights). A quantized weight (runtime/kernels/quant.py) is kept as it is."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    return nn.Parameter(tensor.detach().clone(), requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in float32, then scaled by the weight in the input dtype (as Hugging Face does).
    One C++ call where the kernels run (`fused.py`); else torch's ops (F.rms_norm is slower on CPU for one row:
    it decomposes into more ops than these)."""
    if weight.dtype == x.dtype and fused.available(x):
        return fused.rms_norm(x, weight, eps)[1]
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves layout. x: [b, heads, n, d]; cos, sin: [b, 1, n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)


def layer_step(
    x: torch.Tensor,  # [b, n, hidden]
    cos: torch.Tensor,  # [b, 1, n, d]
    sin: torch.Tensor,  # [b, 1, n, d]
    keys: torch.Tensor,  # [b, Hk, max_len, d]: this layer's cache rows, written in place
    values: torch.Tensor,  # [b, Hk, max_len, d]
    write_index: torch.Tensor,  # [b, n] or [b, 1, n, 1] long cache indices, or [b * Hk * n] flat entries (torch path)
    mask: torch.Tensor,  # [b, 1, n, L] additive
    w: tuple[torch.Tensor | None, ...],  # Block.weights()
    spec: LlamaSpec,
    packed: bool,
    invariant: bool = False,
) -> torch.Tensor:  # [b, n, hidden]
    """One decoder layer's output (`layer_parts` summed)."""
    x, out = layer_parts(x, cos, sin, keys, values, write_index, mask, w, spec, packed, invariant)
    return x + out


def layer_parts(
    x: torch.Tensor,  # [b, n, hidden]
    cos: torch.Tensor,  # [b, 1, n, d]
    sin: torch.Tensor,  # [b, 1, n, d]
    keys: torch.Tensor,  # [b, Hk, max_len, d]: this layer's cache rows, written in place
    values: torch.Tensor,  # [b, Hk, max_len, d]
    write_index: torch.Tensor,  # [b, n] or [b, 1, n, 1] long cache indices, or [b * Hk * n] flat entries (torch path)
    mask: torch.Tensor,  # [b, 1, n, L] additive
    w: tuple[torch.Tensor | None, ...],  # Block.weights(): qkv, qkv bias, o, gate_up, down, attn norm, mlp norm
    spec: LlamaSpec,
    packed: bool,
    invariant: bool = False,  # attention in a fixed order (invariant.block_attention), else torch's SDPA
    pending: torch.Tensor | None = None,  # [b, n, hidden]: the previous layer's MLP output, still to add to x
) -> tuple[torch.Tensor, torch.Tensor]:  # (x + attention, MLP output) [b, n, hidden]: the layer's output is their sum
    """One decoder layer, its output as two terms: the next layer's fused RMSNorm adds them (the residual add and
    the norm in one pass over the rows, the add rounded as torch's), so `model_forward` passes them on. A free function of its weights, so one compiled graph serves every layer (torch.compile
    guards on tensor shapes, not on which layer's tensors come in): compiling costs one layer, not thirty.
    w: Block.weights() (qkv, qkv bias, o, gate_up, down, attention norm, MLP norm).
    Where the C++ kernels run (`fused.py`: CPU, fp32 / bf16) the attention and the small ops are one call each,
    invariant by construction, every chunk length included (a runner that turned invariance off sends chunks of
    more than `fused.MAX_QUERIES` tokens a row to torch's SDPA); else torch's ops (SDPA, or block_attention if
    invariant)."""
    s = spec
    qkv_w, qkv_b, o_w, gate_up_w, down_w, attn_norm, mlp_norm = w
    b, n, _ = x.shape
    if write_index.dim() != 1 and fused.available(x) and attn_norm.dtype == x.dtype:
        x, h = fused.rms_norm(x, attn_norm, s.rms_norm_eps, residual=pending)  # x + pending, normed
        attn = attention(linear(h, qkv_w, qkv_b, packed), cos, sin, keys, values, write_index, mask, s, invariant)
        x, h = fused.rms_norm(linear(attn, o_w, None, packed), mlp_norm, s.rms_norm_eps, residual=x)
        return x, linear(fused.silu_mul(linear(h, gate_up_w, None, packed)), down_w, None, packed)
    if pending is not None:
        x = x + pending
    qkv = linear(rms_norm(x, attn_norm, s.rms_norm_eps), qkv_w, qkv_b, packed)  # [b, n, (H + 2 Hk) d]
    x = x + linear(attention(qkv, cos, sin, keys, values, write_index, mask, s, invariant), o_w, None, packed)
    gate, up = linear(rms_norm(x, mlp_norm, s.rms_norm_eps), gate_up_w, None, packed).chunk(2, dim=-1)  # [b, n, I]
    return x, linear(F.silu(gate) * up, down_w, None, packed)


def attention(
    qkv: torch.Tensor,  # [b, n, (H + 2 Hk) d]: q, k, v before the rotary embedding
    cos: torch.Tensor,  # [b, 1, n, d]
    sin: torch.Tensor,  # [b, 1, n, d]
    keys: torch.Tensor,  # [b, Hk, max_len, d]: this layer's cache rows, k written in place
    values: torch.Tensor,  # [b, Hk, max_len, d]: v written in place
    write_index: torch.Tensor,  # [b, n] or [b, 1, n, 1] long cache indices, or [b * Hk * n] flat entries (torch path)
    mask: torch.Tensor,  # [b, 1, n, L] additive
    spec,  # any spec with num_heads, num_kv_heads, head_dim (LlamaSpec, gemma.GemmaSpec)
    invariant: bool,
) -> torch.Tensor:  # [b, n, H d]: softmax(q k^T / sqrt(d) + mask) v, heads side by side
    """Rotary on q and k, k and v into the cache, attention over [0, L). The C++ kernels where they run for x and
    the cache indices (`fused.py`: invariant by construction, every chunk length included; a runner that turned
    invariance off sends chunks of more than `fused.MAX_QUERIES` tokens a row to torch's SDPA); else torch's ops
    (SDPA, or block_attention if invariant)."""
    s = spec
    b, n, _ = qkv.shape
    if write_index.dim() != 1 and fused.available(qkv):
        q = fused.rotary_write(qkv, cos, sin, write_index.view(b, n), keys, values, s.num_heads)  # [b, H, n, d]
        if invariant or n <= fused.MAX_QUERIES:
            attn = fused.attention(q, keys, values, mask)  # [b, H, n, d], [b, n, H, d] in memory
        else:  # a long prefill chunk of a runner that turned invariance off: torch's flash kernel (fused.py)
            kv_len = mask.shape[-1]
            attn = F.scaled_dot_product_attention(q, keys[:, :, :kv_len].to(q.dtype), values[:, :, :kv_len].to(q.dtype),
                                                  attn_mask=mask, enable_gqa=s.num_heads != s.num_kv_heads)
        return attn.transpose(1, 2).reshape(b, n, -1)
    qk, v = qkv.view(b, n, -1, s.head_dim).transpose(1, 2).split(
        [s.num_heads + s.num_kv_heads, s.num_kv_heads], dim=1)  # [b, H + Hk, n, d], [b, Hk, n, d]
    q, k = rotate(qk, cos, sin).split([s.num_heads, s.num_kv_heads], dim=1)  # one rotation for q and k
    if write_index.dim() != 1:  # cache indices: their flat entries
        write_index = entry_index(write_index.view(b, n), s.num_kv_heads, keys.shape[2])  # [b * Hk * n]
    write_entries(keys, write_index, k)
    write_entries(values, write_index, v)
    kv_len = mask.shape[-1]
    if invariant:
        attn = block_attention(q, keys, values, mask)  # [b, H, n, d]
    else:
        attn = F.scaled_dot_product_attention(q, keys[:, :, :kv_len].to(q.dtype), values[:, :, :kv_len].to(q.dtype),
                                              attn_mask=mask, enable_gqa=s.num_heads != s.num_kv_heads)  # [b, H, n, d]
    return attn.transpose(1, 2).reshape(b, n, -1)


class Block(nn.Module):
    """One decoder layer's weights (q/k/v and gate/up fused); `layer_step` runs it."""

    def __init__(self, spec: LlamaSpec, weights: dict[str, torch.Tensor], pack: bool, invariant: bool = False) -> None:
        super().__init__()
        self.spec = spec
        w = weights
        qkv_bias = torch.cat([w["q_proj.bias"], w["k_proj.bias"], w["v_proj.bias"]]) if spec.qkv_bias else None
        qkv_w = torch.cat([w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"]])
        self.qkv = Linear(qkv_w, qkv_bias, pack, invariant)
        self.o = Linear(w["o_proj.weight"], None, pack, invariant)
        self.gate_up = Linear(torch.cat([w["gate_proj.weight"], w["up_proj.weight"]]), None, pack, invariant)
        self.down = Linear(w["down_proj.weight"], None, pack, invariant)
        self.attn_norm = own(w["input_layernorm.weight"])  # [hidden]
        self.mlp_norm = own(w["post_attention_layernorm.weight"])  # [hidden]
        self.packed = self.qkv.packed
        assert all(m.packed == self.packed for m in (self.o, self.gate_up, self.down))

    def weights(self) -> tuple[torch.Tensor | None, ...]:
        return (self.qkv.weight, self.qkv.bias, self.o.weight, self.gate_up.weight, self.down.weight,
                self.attn_norm, self.mlp_norm)


class LlamaModel(nn.Module):
    """The decoder and LM head. `forward` runs one step of the runner: fed tokens in, chosen positions' logits out."""

    def __init__(self, spec: LlamaSpec, weights: dict[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                 pack: bool = True, invariant: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.invariant = invariant  # row-invariant linears (wide weights in input chunks): a batch_invariant runner's
        self.embed = own(weights["model.embed_tokens.weight"])  # [vocab, hidden]
        self.layers = nn.ModuleList(
            Block(spec, {".".join(k.split(".")[-2:]): v for k, v in weights.items()  # "q_proj.weight", ...
                         if k.startswith(f"model.layers.{i}.")}, pack, invariant)
            for i in range(spec.num_layers)
        )
        self.norm = own(weights["model.norm.weight"])  # [hidden]
        self.lm_head = Linear(weights.get("lm_head.weight", self.embed), None, pack, invariant)
        self.cos = nn.Buffer(rope[0], persistent=False)  # [max_len, d]
        self.sin = nn.Buffer(rope[1], persistent=False)  # [max_len, d]
        assert all(layer.packed == self.lm_head.packed for layer in self.layers)  # model_forward takes one flag
        onto_huge_pages(self.linears())
        self._loop: list = []  # layer_loop.build's, made on the first eager forward (the weights are final then)
        self._layer_weights: list = []  # every Block.weights(), gathered once (~4 us a layer through nn.Module)
        self._structure: list = []  # [the embedding it was computed for, `structure()`]

    def linears(self) -> list[Linear]:
        """Every linear, in the order a step runs them: each layer's qkv, o, gate_up, down, then the LM head."""
        return [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]


    def layer_loop(self) -> layer_loop.Loop | None:
        """The C++ loop over this model's layers (`layer_loop.py`), or None where it does not serve."""
        if not self._loop:
            self._loop.append(layer_loop.build(self.tensors().layers, self.lm_head.packed, self.spec))
        return self._loop[0]

    def tensors(self) -> ModelTensors:
        """The weights `model_forward` takes (a compiled program takes them as inputs, so it holds no copy)."""
        if not self._layer_weights:  # a Block's tensors are fixed once built (the embedding may be rebound: read anew)
            self._layer_weights.append(tuple(layer.weights() for layer in self.layers))
        return ModelTensors(self.embed, self.cos, self.sin, self._layer_weights[0], self.norm, self.lm_head.weight)

    def forward(
        self,
        token_ids: torch.Tensor,  # [b, n] long
        positions: torch.Tensor,  # [b, n] long: rotary positions
        write_index: torch.Tensor,  # [b, n] long: cache index of each fed token
        mask: torch.Tensor,  # [b, 1, n, L] additive
        keys: list[torch.Tensor],  # per layer [b, Hk, max_len, d]
        values: list[torch.Tensor],  # per layer [b, Hk, max_len, d]
        select: torch.Tensor | None = None,  # [b, m] long: fed-token indices whose logits are wanted (None: all)
        compiled: tuple | None = None,  # (shape class, {argument: dims dynamic}): run the compiled program
        all_hidden: bool = False,  # hidden of all n fed tokens, not only the selected ones
        invariant: bool = False,  # batch- and width-invariant attention (invariant.py)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [b, m, vocab], hidden [b, m or n, hidden]
        args = (self.tensors(), self.spec, self.lm_head.packed, token_ids, positions, write_index, mask, tuple(keys),
                tuple(values), select, all_hidden, invariant)
        if compiled is not None:  # the compiled program runs the layers itself: no C++ loop
            shape_class, dynamic = compiled
            key = (self.structure(), shape_class, tuple(keys[0].shape[1:]), str(keys[0].dtype), all_hidden, invariant)
            return run_program(model_forward, key, args, {MODEL_ARGS[name]: dims for name, dims in dynamic.items()})
        return model_forward(*args, self.layer_loop())

    def _weights(self) -> list:
        tensors = self.tensors()
        return [tensors.lm_head] + [w for layer in tensors.layers for w in layer]

    def quantized(self) -> bool:
        """Whether any linear holds quantized blocks (runtime/kernels/quant.py), which only eager steps run."""
        return any(w is not None and not isinstance(w, (torch.Tensor, tuple)) for w in self._weights())

    def integer_activations(self) -> bool:
        """Whether any linear computes with integer activations (`--activations q8`: another model than the fp32
        conversion already, where a 16-bit KV cache is `--kv-cache-dtype auto`'s choice)."""
        return any(getattr(w, "activations", None) == "q8" for w in self._weights())

    def structure(self) -> str:
        """What fixes a compiled program's code besides the sources: the spec, the packing, every weight's type,
        shape and dtype (computed once per embedding tensor: the embedding may be rebound)."""
        if not self._structure or self._structure[0] is not self.embed:
            tensors = self.tensors()
            flat = [tensors.embed, tensors.cos, tensors.sin, tensors.norm, tensors.lm_head]
            flat += [w for layer in tensors.layers for w in layer]
            parts = [None if w is None else
                     (type(w).__name__, tuple(getattr(w, "shape", ())), str(getattr(w, "dtype", "")))
                     for w in flat]
            self._structure[:] = [self.embed, repr((self.spec, self.lm_head.packed, parts))]
        return self._structure[1]


def onto_huge_pages(linears: list[Linear]) -> None:
    """Every linear's weight (dense-packed or quantized: what a step streams) moved into one arena on huge pages,
    in the order a step reads them (`hugepages.arena`: a layer's weights are each under 2 MiB, so alone they sit
    on 4 KiB pages). A weight shared by two linears (a tied LM head) moves once. Each old copy is let go as soon
    as it is moved (the embedded GGUF target: peak and resident memory after load +19 MB for 96 MB of blocks)."""
    owners: dict[int, list] = {}  # id of the weight -> [(shape, dtype), the weight, the linears holding it]
    for linear in linears:
        w = linear.weight
        if isinstance(w, ReducedHead):  # its rows are what a step reads
            w = w.weight
        if linear.packed == DENSE:
            owners.setdefault(id(w), [(w.shape, w.dtype), w]).append(linear)
        elif isinstance(w, quant.QuantWeight):  # packed into its place as it moves (`pack_into`): never all at once
            owners.setdefault(id(w), [w.packed_spec(), w])
    entries = list(owners.values())
    del owners
    made = hugepages.arena_for([entry[0] for entry in entries])
    if made is None:
        return
    buffer, views = made
    for i, view in enumerate(views):
        _, weight, *holders = entries[i]
        entries[i] = None  # with `weight` gone below, nothing here holds the old copy any more
        if isinstance(weight, quant.QuantWeight):
            weight.pack_into(view)
        else:
            view.copy_(weight)
            for linear in holders:
                linear.weight = nn.Parameter(view, requires_grad=False)
        del weight, holders
    hugepages.settle(buffer)


class ModelTensors(NamedTuple):
    embed: torch.Tensor  # [vocab, hidden]
    cos: torch.Tensor  # [max_len, d]
    sin: torch.Tensor  # [max_len, d]
    layers: tuple[tuple[Weight | None, ...], ...]  # per layer: Block.weights()
    norm: torch.Tensor  # [hidden]
    lm_head: Weight  # [vocab, hidden], packed, or packed input chunks


# model_forward's arguments by name -> position (a compiled program's dynamic dims are named per argument)
MODEL_ARGS = {"token_ids": 3, "positions": 4, "write_index": 5, "mask": 6, "keys": 7, "values": 8, "select": 9}


def model_forward(
    w: ModelTensors,
    spec: LlamaSpec,
    packed: bool,
    token_ids: torch.Tensor,  # [b, n] long
    positions: torch.Tensor,  # [b, n] long: rotary positions
    write_index: torch.Tensor,  # [b, n] long: cache index of each fed token
    mask: torch.Tensor,  # [b, 1, n, L] additive
    keys: tuple[torch.Tensor, ...],  # per layer [b, Hk, max_len, d]
    values: tuple[torch.Tensor, ...],  # per layer [b, Hk, max_len, d]
    select: torch.Tensor | None,  # [b, m] long: fed-token indices whose logits are wanted (None: all)
    all_hidden: bool,  # hidden of all n fed tokens, not only the selected ones
    invariant: bool = False,  # batch- and width-invariant attention (invariant.py)
    loop: layer_loop.Loop | None = None,  # the layers' C++ loop (eager only), used where it serves
) -> tuple[torch.Tensor, torch.Tensor]:  # logits [b, m, vocab], hidden [b, m or n, hidden]
    """The whole step as a free function of the weights: embedding, every layer, final norm, the LM head at the
    selected positions only. Eager, or compiled as one program (`compile.py`). The layers run in `loop` (one C++
    call, the same bits) where it serves, else as `layer_parts` one by one."""
    x = F.embedding(token_ids, w.embed)  # [b, n, hidden]
    cos = w.cos[positions].unsqueeze(1).to(x.dtype)  # [b, 1, n, d]: once per step, in the model's dtype
    sin = w.sin[positions].unsqueeze(1).to(x.dtype)
    # the kernels take the cache indices; torch's path their flat entries, made once a step
    index = write_index if fused.available(x) else entry_index(write_index, spec.num_kv_heads, keys[0].shape[2])
    if layer_loop.serves(loop, x, index, invariant):
        x, out = layer_loop.run(loop, x, cos, sin, index, keys, values, mask)
    else:
        out = None  # [b, n, hidden]: the last layer's MLP output, added to x by the next layer's norm or here
        for layer, k, v in zip(w.layers, keys, values):
            x, out = layer_parts(x, cos, sin, k, v, index, mask, layer, spec, packed, invariant, out)
    x = x + out
    if all_hidden:  # normed once, at every position; the selected rows are gathered from it (the norm is per row)
        every = rms_norm(x, w.norm, spec.rms_norm_eps)  # [b, n, hidden]
        hidden = every if select is None else every.gather(1, select.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return linear(hidden, w.lm_head, None, packed), every
    if select is not None:
        x = x.gather(1, select.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # [b, m, hidden]
    hidden = rms_norm(x, w.norm, spec.rms_norm_eps)
    return linear(hidden, w.lm_head, None, packed), hidden
