"""One record per model family verispec builds from a GGUF file's blocks: what the file calls things and how
llama.cpp's converter laid them out, so the blocks become the values of the fp32 conversion transformers makes of
the same file. A new family is a new row (and, where its layers differ from a Llama layer, its model in model/).

What a record says:
- `name`: the file's `general.architecture`; `model_type` / `hf_class`: what transformers calls it; `native`: which
  of verispec's models builds it ("llama": llama.py, "gemma3": gemma.py).
- `metadata`: the GGUF keys (after "<name>.") read into the config, `ignored`: the keys known and not needed
  (their values follow from others). A key under "<name>." that is in neither is a field the code does not know:
  the file is not built from its blocks (`Unknown`), never run on a guessed layout.
- `layer_tensors`: tensor names after "blk.N." -> Hugging Face's after "model.layers.N."; a tensor in neither this
  nor the top-level names is refused the same way (rope scaling's `rope_freqs.weight`, say).
- `permuted_qk`: llama.cpp's converter interleaved the q/k rows for its rotary layout (Llama files only: Qwen2 and
  Gemma 3 files keep Hugging Face's order); undone on read, whole rows at a time (each row is quantized on its own).
- `qkv_bias`: q/k/v carry biases; `norm_offset`: the file stores every norm weight + this (Gemma 3's 1 + w);
  `hidden_act`: the MLP's gate activation; `config`: config fields every file of the family has and none stores.
- A separate LM head is the file's `output.weight` where it has one, else the embedding (tied): read from the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

GLOBAL, SLIDING = "full_attention", "sliding_attention"  # Gemma 3's layer kinds, as transformers names them


class UnsupportedModel(ValueError):
    """The model is outside verispec's own models; the caller falls back to Hugging Face modeling (saying so)."""


class Unknown(UnsupportedModel):
    """A GGUF file's architecture, metadata key or tensor that no record knows: its blocks are not built."""


def _frozen(mapping: Mapping) -> Mapping:
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class Architecture:
    name: str  # GGUF general.architecture
    model_type: str  # transformers' model_type
    hf_class: str  # transformers' architectures entry
    native: str  # verispec's model that builds it: "llama" (llama.py) or "gemma3" (gemma.py)
    metadata: Mapping[str, str]  # GGUF key after "<name>." -> config field
    layer_tensors: Mapping[str, str]  # GGUF name after "blk.N." (no ".weight") -> HF's after "model.layers.N."
    permuted_qk: bool
    qkv_bias: bool
    hidden_act: str
    norm_offset: float = 0.0
    ignored: frozenset[str] = frozenset()  # GGUF keys after "<name>." known and not read
    config: Mapping[str, object] = field(default_factory=dict)  # fixed config fields

    def hf_name(self, gguf_name: str) -> str | None:
        """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for a name not in the record."""
        parts = gguf_name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in self.layer_tensors:
            return f"model.layers.{parts[1]}.{self.layer_tensors[parts[2]]}.{parts[3]}"
        if len(parts) == 2 and parts[0] in TOP_TENSORS:
            return f"{TOP_TENSORS[parts[0]]}.{parts[1]}"
        return None

    def check(self, metadata: Mapping[str, object], tensor_names: list[str]) -> None:
        """Unknown naming the first metadata key or tensor this record does not know."""
        prefix = f"{self.name}."
        for key in metadata:
            if key.startswith(prefix) and key[len(prefix):] not in self.metadata and key[len(prefix):] not in self.ignored:
                raise Unknown(f"GGUF metadata key {key!r} is not in verispec's {self.name} record "
                              "(runtime/model/architectures.py)")
        for name in tensor_names:
            if self.hf_name(name) is None:
                raise Unknown(f"GGUF tensor {name!r} is not in verispec's {self.name} record "
                              "(runtime/model/architectures.py)")


# transformers' names (after "model.layers.N.") of the tensors every Llama-like layer has
_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF keys (after "<name>.") every Llama-like family stores, -> transformers' config fields
_SHAPE = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
    "rope.freq_base": "rope_theta",
}

LLAMA = Architecture(
    "llama", "llama", "LlamaForCausalLM", "llama", _frozen({**_SHAPE, "rope.dimension_count": "head_dim"}),
    _frozen(_LAYER), permuted_qk=True, qkv_bias=False, hidden_act="silu")
QWEN2 = Architecture(
    "qwen2", "qwen2", "Qwen2ForCausalLM", "llama", _frozen(_SHAPE), _frozen(_LAYER), permuted_qk=False,
    qkv_bias=True, hidden_act="silu")
GEMMA3 = Architecture(
    "gemma3", "gemma3_text", "Gemma3ForCausalLM", "gemma3",
    _frozen({**_SHAPE, "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"}),
    _frozen({**_LAYER, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm"}),
    permuted_qk=False, qkv_bias=False, hidden_act="gelu_pytorch_tanh", norm_offset=1.0,
    ignored=frozenset({"attention.value_length"}),  # equal to key_length in every Gemma 3
    config=_frozen({
        "sliding_window_pattern": 6,  # every 6th layer global (llama.cpp's and transformers' default)
        "local_rope_theta": 10000.0,  # the sliding layers' rotary base (not in the file; both converters' default)
    }))

ARCHITECTURES = {arch.name: arch for arch in (LLAMA, QWEN2, GEMMA3)}


def architecture(name: str | None) -> Architecture:
    """The record of a GGUF file's `general.architecture`; Unknown naming the ones there are."""
    if name not in ARCHITECTURES:
        raise Unknown(f"GGUF architecture {name!r} is not in verispec's table (runtime/model/architectures.py: "
                      f"{', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[name]


def of_model_type(model_type: str | None) -> Architecture | None:
    """The record whose Hugging Face model_type this is (None for another)."""
    return next((a for a in ARCHITECTURES.values() if a.model_type == model_type), None)
