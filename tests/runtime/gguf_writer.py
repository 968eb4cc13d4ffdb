"""Tiny GGUF files written as llama.cpp's converter writes them, for any architecture record
(runtime/model/architectures.py): its metadata keys, its tensor names, q/k rows permuted where the record says the
converter permutes them, norms stored with the record's offset, linears quantized (gguf-py's reference quantizer).
`permute` may be forced either way: the negative controls write a file whose rows lie about their layout."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from verispec.runtime.model.architectures import TOP_TENSORS, Architecture

# which block type each linear is written in (block size 32 divides the tiny models' widths); the rest F32
LINEAR_TYPES = {"self_attn.q_proj": "Q8_0", "self_attn.k_proj": "Q8_0", "self_attn.v_proj": "Q5_0",
                "self_attn.o_proj": "Q8_0", "mlp.gate_proj": "Q4_0", "mlp.up_proj": "Q4_1", "mlp.down_proj": "Q8_0"}


def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of a Llama q/k weight's rows (its rotary layout)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: str | Path, arch: Architecture, permute: bool | None = None,
               head_type: str = "Q8_0") -> Path:
    """model (a Hugging Face causal LM of arch's family) -> a GGUF file at path, as llama.cpp writes one."""
    cfg = model.config
    permute = arch.permuted_qk if permute is None else permute
    writer = gguf.GGUFWriter(str(path), arch.name)
    values = {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
              "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
              "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
              "rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads, "vocab_size": cfg.vocab_size}
    for key, value in values.items():
        if key in arch.metadata:
            writer.add_uint32(f"{arch.name}.{key}", value)
    writer.add_float32(f"{arch.name}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{arch.name}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_eos_token_id(cfg.eos_token_id if cfg.eos_token_id is not None else 0)
    to_gguf = {hf: g for g, hf in arch.layer_tensors.items()}
    top = {hf: g for g, hf in TOP_TENSORS.items()}
    for name, tensor in model.state_dict().items():
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        w = tensor.float().numpy()
        *stem, leaf = name.split(".")
        if name.startswith("model.layers."):
            layer, module = stem[2], ".".join(stem[3:])
            gguf_name, qtype = f"blk.{layer}.{to_gguf[module]}.{leaf}", LINEAR_TYPES.get(module)
            if permute and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads
                w = llamacpp_permute(w, heads)
        else:
            gguf_name, qtype = f"{top['.'.join(stem)]}.{leaf}", head_type if stem[-1] in ("lm_head",) else None
            if name == "model.embed_tokens.weight":
                qtype = "Q8_0"
        if leaf == "bias" or qtype is None:  # biases and norms: float, norms with the record's offset
            writer.add_tensor(gguf_name, w + arch.norm_offset if name.endswith("norm.weight") else w)
            continue
        kind = gguf.GGMLQuantizationType[qtype]
        raw = gguf.quants.quantize(w, kind)
        writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def converted(path: Path) -> torch.nn.Module:
    """transformers' fp32 conversion of a GGUF file (its reference reading of the file's layout)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
