"""Every decoder layer of an eager native step in one C++ call (`layer_loop.h`, part of `fused.py`'s extension).

`llama.layer_parts` on its fused path is ~9 kernel calls a layer, 270 a step of the embedded model; between them
Python (wrappers, `QuantWeight.__torch_function__`, views) took about as long as the small ops themselves. The
loop makes the same calls with the same arguments from C++, so its results are bitwise those of the Python loop
(`tests/kernels/test_layer_loop.py`). `GemmaLoop` does the same for Gemma 3's layer (`gemma.layer_parts`: four
norms, q/k norms per head, a rotary table and a mask per layer kind, gelu_tanh * up). It serves where every linear
of the model is a `QuantWeight` or packed for `dense.py`'s kernel and the layer kernels run (`fused.available`);
elsewhere (oneDNN's packed or plain weights, the torch fallback, torch.compile, long chunks sent to SDPA)
`llama.model_forward` and `gemma.GemmaModel.forward` keep their Python loops.
`ENABLED = False` (or the test override `VERISPEC_LAYER_LOOP=python`, runtime/overrides.py) keeps the Python loop
everywhere, for measurements side by side (`recipes/step_breakdown.py --loops python,cpp`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import overrides
from . import dense, fused, quant

ENABLED: bool | None = None  # None: the C++ loop where it serves, unless VERISPEC_LAYER_LOOP=python
QUANT, DENSE = 0, 1  # layer_loop.h's kinds of linear


class Loop(NamedTuple):
    ext: object  # layer_loop.h's LlamaLoop
    dtype: torch.dtype  # the norms' dtype: the activations' it serves
    dense_dtype: torch.dtype | None  # the dense weights' (their kernel path is chosen per dtype), None if none


class _Linears:
    """The kernel arguments of a model's linears, gathered layer by layer (`row`), and the kernels they need."""

    def __init__(self, packed) -> None:
        self.packed = packed
        self.quant_fn = self.dense_fn = 0
        self.dense_dtype: torch.dtype | None = None

    def row(self, weights) -> list | None:
        """[(weight, bias or None)] of one layer -> their kernel arguments, or None where one is neither a
        QuantWeight nor in dense.py's layout."""
        row = []
        for weight, bias in weights:
            if isinstance(weight, quant.QuantWeight) and quant.kernel() is not None:
                self.quant_fn = self.quant_fn or quant.kernel().quant_linear_address()
                row.append((QUANT, weight.packed, weight._scales_arg, _or_empty(bias), weight.kernel_id,
                            weight.shape[1], weight.shape[0]))
            elif self.packed == "dense" and isinstance(weight, torch.Tensor):  # llama.DENSE (llama imports this)
                self.dense_fn = self.dense_fn or dense.kernel().dense_linear_address()
                self.dense_dtype = weight.dtype
                bias = _or_empty(None if bias is None else bias.float())
                row.append((DENSE, weight, _EMPTY, bias, 0, 0, weight.shape[0]))  # (in: the rows' own)
            else:
                return None
        return row


def build(layers, packed, spec) -> Loop | None:
    """layers: per layer `Block.weights()`; packed: their `Linear.packed` -> the loop over them, or None where
    some weight is neither a QuantWeight nor in dense.py's layout, or the kernels are not built."""
    ext = fused.kernel()
    if ext is None or not hasattr(ext, "LlamaLoop"):
        return None
    kernels, linears, norms = _Linears(packed), [], []
    for qkv_w, qkv_b, o_w, gate_up_w, down_w, attn_norm, mlp_norm in layers:
        row = kernels.row(((qkv_w, qkv_b), (o_w, None), (gate_up_w, None), (down_w, None)))
        if row is None:
            return None
        linears.append(row)
        norms.append((attn_norm, mlp_norm))
    if len({n.dtype for pair in norms for n in pair}) != 1:
        return None
    loop = ext.LlamaLoop(linears, norms, spec.num_heads, spec.rms_norm_eps, kernels.quant_fn, kernels.dense_fn)
    return Loop(loop, norms[0][0].dtype, kernels.dense_dtype)


def build_gemma(layers, packed, spec) -> Loop | None:
    """layers: per layer `gemma.GemmaBlock.weights()`; spec: a `gemma.GemmaSpec` (its layer kinds) -> the
    `GemmaLoop` over them, or None where `build` would give none."""
    ext = fused.kernel()
    if ext is None or not hasattr(ext, "GemmaLoop"):
        return None
    kernels, linears, norms = _Linears(packed), [], []
    for qkv_w, o_w, gate_up_w, down_w, *layer_norms in layers:
        row = kernels.row(((qkv_w, None), (o_w, None), (gate_up_w, None), (down_w, None)))
        if row is None:
            return None
        linears.append(row)
        norms.append(layer_norms)  # input, post-attention, pre-MLP, post-MLP, q, k
    if len({n.dtype for layer in norms for n in layer}) != 1:
        return None
    loop = ext.GemmaLoop(linears, norms, list(spec.sliding), spec.num_heads, spec.num_kv_heads, spec.rms_norm_eps,
                         kernels.quant_fn, kernels.dense_fn)
    return Loop(loop, norms[0][0].dtype, kernels.dense_dtype)


def enabled() -> bool:
    """Whether the C++ loop may serve (`ENABLED`, else the test override)."""
    if ENABLED is not None:
        return ENABLED
    return (overrides.read("VERISPEC_LAYER_LOOP") or "cpp").lower() != "python"


def serves(loop: Loop | None, x: torch.Tensor, index: torch.Tensor, invariant: bool) -> bool:
    """Whether `run` does what `llama.layer_parts`' loop would for x [b, n, hidden]: its fused path (the kernels
    for x, cache indices), the kernel's attention (not SDPA), eager."""
    return (loop is not None and enabled() and x.dtype == loop.dtype and index.dim() != 1
            and (invariant or x.shape[1] <= fused.MAX_QUERIES) and fused.available(x)
            and not torch.compiler.is_compiling())


def run(
    loop: Loop,
    x: torch.Tensor,  # [b, n, hidden]: the embedding
    cos: torch.Tensor,  # [b, 1, n, d]
    sin: torch.Tensor,  # [b, 1, n, d]
    index: torch.Tensor,  # [b, n] long cache indices
    keys: tuple[torch.Tensor, ...],  # per layer [b, Hk, max_len, d], written at index
    values: tuple[torch.Tensor, ...],  # per layer [b, Hk, max_len, d]
    mask: torch.Tensor,  # [b, 1, n, L] additive
) -> tuple[torch.Tensor, torch.Tensor]:  # (x + attention, MLP output) [b, n, hidden] of the last layer
    """`llama.layer_parts` over every layer (the same arguments, `pending` starting as None), where `serves`."""
    dense_path = None if loop.dense_dtype is None else dense.default_path(loop.dense_dtype)
    x, out = loop.ext.run(x, cos, sin, index, keys, values, mask, fused.attention_path(x.shape[1]),
                          quant.KERNEL_PATH, dense.PATHS["avx512"] if dense_path is None else dense_path)
    return x, out


def run_gemma(
    loop: Loop,
    x: torch.Tensor,  # [b, n, hidden]: the scaled embedding
    rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],  # sliding -> (cos, sin) [b, 1, n, d], the kinds present
    index: dict[bool, torch.Tensor],  # sliding -> [b, n] long: where such a layer writes each fed token
    keys: tuple[torch.Tensor, ...],  # per layer [b, Hk, entries, d], written at its kind's index
    values: tuple[torch.Tensor, ...],  # per layer, as keys
    masks: dict[bool, torch.Tensor],  # sliding -> [b, 1, n, L] additive, over that kind's entries
) -> tuple[torch.Tensor, torch.Tensor]:  # (x + normed attention, normed MLP output) [b, n, hidden] of the last layer
    """`gemma.layer_parts` over every layer (`pending` starting as None), where `serves`."""
    dense_path = None if loop.dense_dtype is None else dense.default_path(loop.dense_dtype)
    tables = [t for kind in (False, True) for t in rope.get(kind, (_EMPTY, _EMPTY))]
    return tuple(loop.ext.run(x, tables, [index[False], index[True]], keys, values, [masks[False], masks[True]],
                              fused.attention_path(x.shape[1]), quant.KERNEL_PATH,
                              dense.PATHS["avx512"] if dense_path is None else dense_path))


_EMPTY = torch.empty(0)


def _or_empty(bias: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if bias is None else bias
