"""A GGUF file's weights as they are: quantized linears stay in their blocks (`quant.QuantWeight`), the rest float32.

`read_gguf_weights` names them as Hugging Face does (what `LlamaModel` and `GemmaModel` take), undoes llama.cpp's
q/k row permutation on a Llama file's quantized rows (each row is quantized on its own, so permuting rows commutes
with dequantizing) and, in a Gemma 3 file, the + 1 llama.cpp's converter added to every norm weight: every
weight's values are those of the fp32 conversion transformers makes of the same file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..kernels.quant import NATIVE_TYPES, V_LAYOUTS, QuantWeight
from .gguf_file import open_gguf

# GGUF tensor name (after "blk.N.") -> Hugging Face's name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
# Gemma 3's names where they differ: four norms a layer (llama.cpp's ffn_norm is the pre-feedforward one), q/k norms
_GEMMA3_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
                 "attn_k_norm": "self_attn.k_norm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def unsupported_types(path: str | Path) -> tuple[list[str], list[str]]:
    """The block types of a GGUF file's model tensors: (the ones `--weights gguf` runs, the ones it does not),
    read from the file's header (`gguf_file.open_gguf`: parsed once, no tensor read)."""
    file = open_gguf(path)
    arch = file.metadata.get("general.architecture")
    kinds = {info.type_name for info in file.tensors if hf_name(info.name, arch)}
    return sorted(kinds & set(NATIVE_TYPES)), sorted(kinds - set(NATIVE_TYPES) - set(_FLOAT_TYPES))


def tensor_activations(kind: str, activations: str) -> str:
    """What a tensor of block type `kind` computes with when the model asks for `activations`: integer activations
    ("q8") run the types with an integer layout (quant.V_LAYOUTS: every native type, the K-quants included); a type
    without one would keep fp32 activations (the fp32 conversion's values)."""
    return activations if kind in V_LAYOUTS else "fp32"


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (names of the file's `architecture`); None
    for tensors the model does not use."""
    parts = gguf_name.split(".")
    names = _GEMMA3_NAMES if architecture == "gemma3" else _LAYER_NAMES
    if parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[-1]}"
    if parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[-1]}"
    return None


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' reverse permutation of llama.cpp's q/k rows, on whole rows: [out, ...] -> [out, ...] (moved in
    numpy: its strided copies of small rows are far faster than torch's)."""
    out = rows.shape[0]
    moved = rows.numpy().reshape(heads, out // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2)
    return torch.from_numpy(np.ascontiguousarray(moved).reshape(rows.shape))


def read_gguf_weights(path: str | Path, num_heads: int, num_kv_heads: int,
                      activations: str = "fp32") -> dict[str, torch.Tensor | QuantWeight]:
    """-> {Hugging Face name: float32 tensor or QuantWeight (computing with `activations`: quant.py)}. ValueError
    for a tensor type without a kernel."""
    weights: dict[str, torch.Tensor | QuantWeight] = {}
    file = open_gguf(path)
    arch = file.metadata.get("general.architecture")
    for info in file.tensors:
        name, kind = hf_name(info.name, arch), info.type_name
        if name is None:
            continue
        if kind not in _FLOAT_TYPES and kind not in NATIVE_TYPES:
            raise ValueError(f"{path}: tensor {info.name} is {kind}, which --weights gguf does not run "
                             f"(it runs {', '.join(NATIVE_TYPES)}): use --weights fp32 (the converted model)")
        raw = torch.from_numpy(file.read(info))  # [nbytes] uint8
        if kind in _FLOAT_TYPES:
            value = raw.view(_FLOAT_TYPES[kind]).float().reshape(info.shape)
        else:
            value = raw.view(info.shape[0], -1)  # [out, row_bytes]
        if arch != "gemma3" and (".q_proj." in name or ".k_proj." in name):  # (Gemma's rows are not permuted)
            value = _unpermute(value, num_heads if ".q_proj." in name else num_kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):  # as transformers' conversion undoes it
            value = value - 1
        weights[name] = value if kind in _FLOAT_TYPES else \
            QuantWeight(kind, value, info.shape[-1], activations=tensor_activations(kind, activations))
    return weights
