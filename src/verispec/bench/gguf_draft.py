"""A Llama-family draft model folder (safetensors) written as a GGUF file, so llama.cpp can draft with the same
draft model verispec does (`verispec bench --peers llama.cpp`, its "draft model" mode).

The tokenizer is copied from the target's GGUF (a draft shares its target's tokenizer: `models.load_pair` checks
it), the weights keep their dtype where GGUF has it (F16 stays F16, anything else becomes F32; norms are F32 as
llama.cpp wants them). q and k rows are permuted from Hugging Face's rotate-half rotary layout to the adjacent
pairs llama.cpp's `llama` architecture rotates, as llama.cpp's own converter does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

# Hugging Face name (after "model.layers.{i}.") -> GGUF name (after "blk.{i}.").
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def rotary_to_pairs(weight: np.ndarray, heads: int) -> np.ndarray:
    """[heads * head_dim, in] rows of q or k in rotate-half order (i, i + head_dim/2) -> adjacent pairs (2i, 2i+1)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str | None:
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    return None


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    """The folder's safetensors as numpy arrays: float16 kept, every other float dtype as float32."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            out[name] = (tensor if tensor.dtype == torch.float16 else tensor.float()).numpy()
    if not out:
        raise ValueError(f"{folder} holds no .safetensors weights to convert to GGUF")
    return out


def write_draft_gguf(folder: Path, target_gguf: Path, out: Path) -> Path:
    """Write the draft model in `folder` as the GGUF file `out`, with the tokenizer of `target_gguf`."""
    import gguf

    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") not in ("llama", "mistral") or config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{folder}: only Llama-family drafts without biases convert to GGUF here")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{folder}: rope_type {rope['rope_type']!r} is not converted to GGUF here")
    tensors = _tensors(folder)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(folder.name)
    writer.add_context_length(config.get("max_position_embeddings", 8192))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    half = all(t.dtype == np.float16 for t in tensors.values())
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if half else gguf.LlamaFileType.ALL_F32)
    reader = gguf.GGUFReader(str(target_gguf))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for name, array in tensors.items():
        target_name = gguf_name(name)
        if target_name is None:
            raise ValueError(f"{folder}: tensor {name} has no GGUF counterpart here")
        if target_name == "output.weight" and config.get("tie_word_embeddings"):
            continue
        if target_name.endswith("attn_q.weight"):
            array = rotary_to_pairs(array, heads)
        elif target_name.endswith("attn_k.weight"):
            array = rotary_to_pairs(array, kv_heads)
        if array.ndim == 1:
            array = array.astype(np.float32)  # llama.cpp reads norms as F32
        writer.add_tensor(target_name, np.ascontiguousarray(array))
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def cached_draft_gguf(folder: Path, target_gguf: Path, cache: Path) -> Path:
    """The draft's GGUF under `cache`, written once per draft weights and target tokenizer."""
    key = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")) + [folder / "config.json", target_gguf]:
        stat = file.stat()
        key.update(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    out = cache / f"{folder.name}-{key.hexdigest()[:12]}.gguf"
    if not out.is_file():
        partial = out.with_suffix(".partial")
        write_draft_gguf(folder, target_gguf, partial)
        partial.replace(out)
    return out
