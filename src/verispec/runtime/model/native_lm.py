"""A model only the native runner runs, built without Hugging Face modeling: `NativeCausalLM`, and the GGUF file's
blocks made into one (`from_gguf`).

Importing Hugging Face's modeling (or even `LlamaConfig`, which pulls it in) costs about as much as the rest of a
start; a GGUF target whose blocks run as stored needs none of it. So its config is read from the file's metadata
into a `NativeConfig` (a plain `PretrainedConfig` of model type "llama", or `NativeGemmaConfig` of "gemma3_text": the
same fields transformers' conversion sets), its native model (`llama.LlamaModel`, `gemma.GemmaModel`) is built
straight from the blocks, and a `NativeCausalLM` stands where
callers expect the Hugging Face model: the config, the generation config and every weight by its Hugging Face name
and shape (meta tensors: the native model holds the values). Registered as the native twin's source
(`runners/native.adopt`), it runs on `NativeRunner` exactly as a converted model whose weights were released to
the blocks (`quantize_target`) does; it has no forward of its own.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig, PretrainedConfig

from ..runners.hf import is_hf_model
from ..runners.native import adopt, build_model, model_spec, table_positions
from ..weights.gguf import hf_name, read_gguf_weights
from ..weights.gguf_file import GGUFFile, open_gguf
from .gemma import GLOBAL, SLIDING
from .llama import UnsupportedModel


class NativeConfig(PretrainedConfig):
    """A Llama-architecture config without `transformers.models` (whose import costs ~1.5 s): the fields
    `LlamaSpec.from_config`, the memory estimates and the drafters read, as transformers' `LlamaConfig` names them."""

    model_type = "llama"


class NativeGemmaConfig(PretrainedConfig):
    """A Gemma 3 text config without `transformers.models`: the fields `GemmaSpec.from_config` reads, as
    transformers' `Gemma3TextConfig` names them."""

    model_type = "gemma3_text"


# GGUF metadata key (after "llama.") -> the config field transformers' GGUF conversion fills from it
_LLAMA_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size", "rope.dimension_count": "head_dim",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
}
_TOKEN_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
               "padding_token_id": "pad_token_id"}


# Gemma 3's keys (after "gemma3."), where they differ from Llama's
_GEMMA3_KEYS = {**{k: v for k, v in _LLAMA_KEYS.items() if k != "rope.dimension_count"},
                "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"}
GEMMA3_SLIDING_PATTERN = 6  # every 6th layer global, the others sliding (llama.cpp's and transformers' default)
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # the sliding layers' rotary base (not in the file; both converters' default)


def gguf_config(file: GGUFFile, name: str | None = None) -> NativeConfig | NativeGemmaConfig:
    """The config of a GGUF file's model, from its metadata (as transformers' conversion reads it); `name_or_path`
    the name the model was asked for (default: the file's path), what `--draft-model auto` looks pairs up by.
    UnsupportedModel where the blocks alone do not make the model: an architecture other than llama and gemma3, or
    rope scaling (its frequencies are not in the fields read here)."""
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch not in ("llama", "gemma3"):
        raise UnsupportedModel(f"GGUF architecture {arch!r} (the blocks are built directly for 'llama' and "
                               "'gemma3' only)")
    if any(key.startswith(f"{arch}.rope.scaling.") for key in meta) or any(t.name == "rope_freqs.weight"
                                                                          for t in file.tensors):
        raise UnsupportedModel("rope scaling (built through the float conversion)")
    keys = _LLAMA_KEYS if arch == "llama" else _GEMMA3_KEYS
    fields = {field: meta[f"{arch}.{key}"] for key, field in keys.items() if f"{arch}.{key}" in meta}
    fields.update({field: meta[f"tokenizer.ggml.{key}"] for key, field in _TOKEN_KEYS.items()
                   if f"tokenizer.ggml.{key}" in meta})
    if "vocab_size" not in fields:
        fields["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    fields["tie_word_embeddings"] = not any(t.name == "output.weight" for t in file.tensors)
    fields["rms_norm_eps"] = float(fields.get("rms_norm_eps", 1e-6))
    common = dict(name_or_path=name or str(file.path), dtype=torch.float32)
    if arch == "llama":
        return NativeConfig(hidden_act="silu", architectures=["LlamaForCausalLM"], **common, **fields,
                            rope_parameters={"rope_type": "default", "rope_theta": theta})
    layers = fields["num_hidden_layers"]
    return NativeGemmaConfig(
        hidden_activation="gelu_pytorch_tanh", architectures=["Gemma3ForCausalLM"], **common, **fields,
        # scores scaled by head_dim^-1/2, as llama.cpp scales them (transformers' conversion: its default 256, the
        # head dim of every Gemma 3 size but 27B, whose scalar is neither)
        query_pre_attn_scalar=fields["head_dim"],
        layer_types=[GLOBAL if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else SLIDING for i in range(layers)],
        rope_parameters={GLOBAL: {"rope_type": "default", "rope_theta": theta},
                         SLIDING: {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}},
        final_logit_softcapping=None, attn_logit_softcapping=None)


class NativeCausalLM(nn.Module):
    """Stands where a Hugging Face causal LM stands (`config`, `generation_config`, `get_input_embeddings`,
    `get_output_embeddings`, `named_parameters` by Hugging Face name) for a model only the native runner runs."""

    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        self.generation_config = GenerationConfig.from_model_config(config)
        for name, tensor in weights.items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, nn.Parameter(tensor, requires_grad=False))
        if "lm_head.weight" not in weights:  # tied: one parameter, as Hugging Face ties it
            self.add_module("lm_head", nn.Module())
            self.lm_head.weight = self.model.embed_tokens.weight

    def hf_model(self):
        """The Hugging Face model on these weights (shared, not copied), made on first call (imports Hugging Face
        modeling): for what runs Hugging Face modeling (`make_runner` with backend "hf"). ValueError where the
        weights are the native model's only (`from_gguf`)."""
        if getattr(self, "_verispec_released", False):
            raise ValueError("this model's weights are its native model's only (its GGUF blocks): use the runner "
                             "backend 'auto' or 'native', or load it with --weights fp32 for Hugging Face modeling")
        if "_hf" not in self.__dict__:
            from transformers import AutoConfig, AutoModelForCausalLM

            fields = {k: v for k, v in self.config.to_dict().items() if k != "model_type"}
            weight = next(self.parameters())
            config = AutoConfig.for_model(self.config.model_type, **fields)
            model = AutoModelForCausalLM.from_config(config, dtype=weight.dtype)
            model.to(weight.device).load_state_dict(dict(self.named_parameters()), strict=False, assign=True)
            model.tie_weights()
            model.generation_config = self.generation_config
            self.__dict__["_hf"] = model.eval().requires_grad_(False)
        return self.__dict__["_hf"]

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, *args, **kwargs):
        raise TypeError("this model runs on verispec's native runner only (runtime/model/native_lm.py): build a "
                        "runner with make_runner, or load it with --weights fp32 for Hugging Face modeling")


@contextmanager
def _one_thread():
    """torch on one thread while the blocks are moved into place: the copies are memory-bound (one core moves the
    embedded model's ~100 MB in ~0.1 s), and on a busy machine a parallel copy waits for its slowest thread (up to
    ~1 s more, measured with another process on the second of 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def is_causal_lm(obj) -> bool:
    """Whether obj is a loaded causal LM (a Hugging Face model or a `NativeCausalLM`), not a drafter or a name."""
    return isinstance(obj, NativeCausalLM) or is_hf_model(obj)


def from_gguf(path: str | Path, max_len: int = 0, name: str | None = None, activations: str = "fp32") -> NativeCausalLM:
    """A GGUF file's model on its own blocks (every type in quant.NATIVE_TYPES as stored, the rest float32): the
    values of the fp32 conversion transformers makes of the file, without making it. max_len: the rotary table's length at least
    (default: the model's context length); name: what the model was asked by (`gguf_config`). UnsupportedModel where
    `gguf_config` refuses the file, ValueError for a block type the kernel does not run. activations: what the
    blocks compute with (quant.py: 'fp32', or 'q8' integer activations)."""
    file = open_gguf(path)
    config = gguf_config(file, name)
    spec = model_spec(config, max_len)
    positions = table_positions(spec, config, max_len)
    with _one_thread():
        weights = read_gguf_weights(path, spec.num_heads, spec.num_kv_heads, activations)
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])  # tied: the embedding's blocks
        model = build_model(spec, weights, config, positions, pack=False)
    arch = file.metadata.get("general.architecture")
    shapes = {hf_name(info.name, arch): info.shape for info in file.tensors if hf_name(info.name, arch)}
    stand_in = NativeCausalLM(config, {name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    adopt(stand_in, model)
    return stand_in


_FOLDER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps",
                "vocab_size", "max_position_embeddings")


def folder_config(folder: Path) -> NativeConfig | None:
    """A model folder's config.json as a `NativeConfig`, where it is a plain Llama (every field `LlamaSpec` reads
    given, the default rope, no quantization); None otherwise (Hugging Face's `AutoConfig` reads it)."""
    import json

    try:
        fields = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    rope = fields.get("rope_parameters") or {}
    plain = (fields.get("model_type") == "llama" and all(key in fields for key in _FOLDER_KEYS)
             and rope.get("rope_type") == "default" and "rope_theta" in rope and not fields.get("rope_scaling")
             and fields.get("hidden_act", "silu") == "silu" and not fields.get("attention_bias")
             and not fields.get("mlp_bias") and "quantization_config" not in fields)
    return NativeConfig.from_dict(fields) if plain else None


def from_folder(folder: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu") -> NativeCausalLM | None:
    """A plain Llama folder (`folder_config`) with safetensors weights as a `NativeCausalLM` holding them (in dtype,
    on device), without Hugging Face modeling: runners build its native twin as they build a Hugging Face model's,
    from the same tensors. None where the folder is not one (load it with Hugging Face)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = folder_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if config is None or not files:
        return None
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update({name: t.to(device=device, dtype=dtype) for name, t in load_file(file).items()
                        if "rotary_emb" not in name})  # (old checkpoints kept the rotary table: made anew)
    if "model.embed_tokens.weight" not in weights:  # another naming: Hugging Face's loader maps it
        return None
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    config.dtype = dtype
    model = NativeCausalLM(config, weights)
    return model.eval()
