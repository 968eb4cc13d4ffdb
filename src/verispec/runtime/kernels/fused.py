"""The native layer's attention and small ops in C++ (`layer_kernel.cpp`, built on first use by `ext.py`).

One call each where torch issues several ops: attention (decode steps, verify passes, token trees and prefill
chunks alike), rotary on q and k with the k/v cache writes, RMSNorm (with the residual add before it),
silu(gate) * up, and Gemma's q/k norms per head and gelu_tanh(gate) * up. fp32 and bf16 on CPU. Every result is
computed per (row, head, query) in one fixed order, so the layer is batch- and width-invariant by construction:
the attention replaces `invariant.block_attention` where the kernel is built, and torch's SDPA everywhere (decode
steps, verify passes, trees and prefill chunks of any length), so invariance costs nothing. Long chunks take the tiled path (a KV head's queries share each key and
value vector loaded once), which does per query exactly what the one-query path does.

Roundings (what `tests/kernels/test_fused.py` checks): rotary and the residual add bitwise torch's formulas;
RMSNorm Hugging Face's roundings with its own order of the sum of squares; silu's exp within an ulp of torch's
(gelu_tanh as g / (1 + exp(-2u)) on the same exp: within a few ulps of torch's tanh form);
attention's scores in fp32, the exact maximum, sum_j p_j v_j and sum_j p_j in cache order.

Eager calls go straight to the extension (a custom op's dispatch costs tens of microseconds a call); under
torch.compile they are the `verispec::` custom ops below, opaque to Inductor, with fake (meta) versions.
`available(x)` says whether a tensor's dtype and device take the kernels; `ENABLED` switches them off (for
side-by-side measurements: `recipes/step_profile.py --kernels`).
"""

from __future__ import annotations


import torch

from .. import overrides
from .ext import build

ENABLED = True  # False: the torch formulas run (llama.py's fallbacks), for measurements side by side
# Fed tokens per row up to which `attention` serves a runner that turned batch invariance off; past it (long
# prefill chunks) such a runner uses torch's SDPA, as before the tiled path. Invariant runners (the default where
# the kernels are built) use the kernel for every chunk: its tiled path is as fast as SDPA (one thread, SmolLM2
# heads, 128-512 queries: 0.65-0.97x SDPA's time in bf16, 0.9-1.3x in fp32; prefill of the embedded model
# 0.92-1.0x, `recipes/prefill_bench.py`).
MAX_QUERIES = 16
DTYPES = (torch.float32, torch.bfloat16)
# Attention's code paths, all giving the same bits: "tiled" (many queries of one KV head share each key and value
# vector: AVX-512, head dims 32 / 64 / 128 / 256), "vector" (one query at a time, AVX-512), "scalar" (what a CPU without
# AVX-512 runs). "auto": tiled from TILE_QUERIES fed tokens a row, else vector. VERISPEC_ATTENTION_PATH forces one
# (a test override, runtime/overrides.py; read at start-up), so a CI machine with AVX-512 tests the others too. TILE_QUERIES is 1: since the tiled path reads
# a KV head's values once for its g query heads, it beats the one-query path at every width (one thread, thread CPU
# time, SmolLM2 heads, 180 entries: a 16-row decode step 0.6x its time in bf16, 0.78x fp32; one row 0.75-0.85x).
PATHS = {"tiled": 2, "vector": 1, "scalar": 0}
PATH_ENV = "VERISPEC_ATTENTION_PATH"
TILE_QUERIES = 1


def kernel():
    """The C++ extension (built once, cached on disk: `ext.py`), or None where it cannot be built."""
    return build("layer", "layer_kernel.cpp")


def available(x: torch.Tensor) -> bool:
    """Whether x's dtype and device run on the kernels (CPU, fp32 or bf16, the extension built and enabled)."""
    return ENABLED and x.device.type == "cpu" and x.dtype in DTYPES and kernel() is not None


def _ext():
    return None if torch.compiler.is_compiling() else kernel()


def forced_path() -> int | None:
    """VERISPEC_ATTENTION_PATH's path, or None for "auto" (unset)."""
    name = overrides.read(PATH_ENV, "auto").lower()
    if name != "auto" and name not in PATHS:
        raise ValueError(f"{PATH_ENV}={name!r}: choose one of auto, {', '.join(PATHS)}")
    return None if name == "auto" else PATHS[name]


_FORCED = forced_path()


def attention_path(fed: int) -> int:
    """The path a call with `fed` tokens a row takes (a path this build lacks falls back to the next one)."""
    if _FORCED is not None:
        return _FORCED
    return PATHS["tiled"] if fed >= TILE_QUERIES else PATHS["vector"]


def attention(
    q: torch.Tensor,  # [b, H, n, d]
    keys: torch.Tensor,  # [b, Hk, max_len, d]
    values: torch.Tensor,  # [b, Hk, max_len, d]
    mask: torch.Tensor,  # [b, 1, n, L] additive, L <= max_len
) -> torch.Tensor:  # [b, H, n, d] (a view of [b, n, H, d] memory)
    ext, path = _ext(), attention_path(q.shape[2])
    if ext:
        return ext.attention(q, keys, values, mask, path)
    return torch.ops.verispec.attention(q, keys, values, mask, path)


def rotary_write(
    qkv: torch.Tensor,  # [b, n, (H + 2 Hk) d]
    cos: torch.Tensor,  # [b, 1, n, d]
    sin: torch.Tensor,  # [b, 1, n, d]
    index: torch.Tensor,  # [b, n] long: cache index of each fed token
    keys: torch.Tensor,  # [b, Hk, max_len, d]: gets the rotated k at index
    values: torch.Tensor,  # [b, Hk, max_len, d]: gets v at index
    num_heads: int,
) -> torch.Tensor:  # rotated q [b, H, n, d] (a view of [b, n, H, d] memory)
    ext = _ext()
    if ext:
        return ext.rotary_write(qkv, cos, sin, index, keys, values, num_heads)
    return torch.ops.verispec.rotary_write(qkv, cos, sin, index, keys, values, num_heads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., hidden] (+ residual) -> (the sum (x itself without a residual), its RMSNorm) [..., hidden]."""
    ext = _ext()
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    if ext:
        return tuple(ext.rms_norm(x, residual, weight, eps))
    return tuple(torch.ops.verispec.rms_norm(x, residual, weight, eps))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 I] -> [..., I]
    ext = _ext()
    gate_up = gate_up.contiguous()
    return ext.silu_mul(gate_up) if ext else torch.ops.verispec.silu_mul(gate_up)


def qk_norm(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, num_heads: int, num_kv_heads: int,
            eps: float) -> torch.Tensor:
    """qkv [..., (H + 2 Hk) d] -> the same with each q head RMSNormed by q_norm [d], each k head by k_norm [d] (the
    roundings of `rms_norm` per head row), v as it is (Gemma's q/k norms)."""
    ext = _ext()
    qkv = qkv.contiguous()
    if ext:
        return ext.qk_norm(qkv, q_norm, k_norm, num_heads, num_kv_heads, eps)
    return torch.ops.verispec.qk_norm(qkv, q_norm, k_norm, num_heads, num_kv_heads, eps)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 I] -> [..., I]: gelu_tanh(gate) * up (Gemma's MLP)
    ext = _ext()
    gate_up = gate_up.contiguous()
    return ext.gelu_mul(gate_up) if ext else torch.ops.verispec.gelu_mul(gate_up)


# -- the custom ops torch.compile sees ------------------------------------------------------------------------------


@torch.library.custom_op("verispec::attention", mutates_args=())
def _attention_op(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                  path: int) -> torch.Tensor:
    return kernel().attention(q, keys, values, mask, path)


@_attention_op.register_fake
def _(q, keys, values, mask, path):
    b, H, n, d = q.shape
    return q.new_empty(b, n, H, d).transpose(1, 2)


@torch.library.custom_op("verispec::rotary_write", mutates_args=("keys", "values"))
def _rotary_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, num_heads: int) -> torch.Tensor:
    return kernel().rotary_write(qkv, cos, sin, index, keys, values, num_heads)


@_rotary_op.register_fake
def _(qkv, cos, sin, index, keys, values, num_heads):
    b, n, _ = qkv.shape
    return qkv.new_empty(b, n, num_heads, keys.shape[-1]).transpose(1, 2)


@torch.library.custom_op("verispec::rms_norm", mutates_args=())
def _rms_op(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total, normed = kernel().rms_norm(x, residual, weight, eps)
    return (total.clone() if residual is None else total), normed  # a custom op's output may not alias its input


@_rms_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("verispec::silu_mul", mutates_args=())
def _silu_op(gate_up: torch.Tensor) -> torch.Tensor:
    return kernel().silu_mul(gate_up)


@_silu_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("verispec::qk_norm", mutates_args=())
def _qk_norm_op(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, num_heads: int, num_kv_heads: int,
                eps: float) -> torch.Tensor:
    return kernel().qk_norm(qkv, q_norm, k_norm, num_heads, num_kv_heads, eps)


@_qk_norm_op.register_fake
def _(qkv, q_norm, k_norm, num_heads, num_kv_heads, eps):
    return torch.empty_like(qkv)


@torch.library.custom_op("verispec::gelu_mul", mutates_args=())
def _gelu_op(gate_up: torch.Tensor) -> torch.Tensor:
    return kernel().gelu_mul(gate_up)


@_gelu_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
