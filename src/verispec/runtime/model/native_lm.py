"""A model only the native runner runs, built without Hugging Face modeling: `NativeCausalLM`, and the GGUF file's
blocks made into one (`from_gguf`).

Importing Hugging Face's modeling (or even `LlamaConfig`, which pulls it in) costs about as much as the rest of a
start; a GGUF target whose blocks run as stored needs none of it. So its config is read from the file's metadata
into a `NativeLlamaConfig` (a plain `PretrainedConfig` of model type "llama", or `NativeGemmaConfig` of "gemma3_text": the
same fields transformers' conversion sets), its native model (`llama.LlamaModel`, `gemma.GemmaModel`) is built
straight from the blocks, and a `NativeCausalLM` stands where
callers expect the Hugging Face model: the config, the generation config and every weight by its Hugging Face name
and shape (meta tensors: the native model holds the values). Registered as the native twin's source
(`twins.adopt`), it runs on `NativeRunner` exactly as a converted model whose weights were released to
the blocks (`quantize_target`) does; it has no forward of its own.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import GenerationConfig, PretrainedConfig

from ..model.build import build_model, model_spec, table_positions
from ..model.twins import adopt, facts, is_released
from ..weights.gguf_file import GGUFFile, open_gguf
from .architectures import GLOBAL, SLIDING
from .gguf_weights import file_architecture, read_gguf_weights, read_head_rows
from .reduced_head import ReducedHead


class NativeLlamaConfig(PretrainedConfig):
    """A Llama-family config (a Llama or Qwen2 file: `model_type` says which) without `transformers.models` (whose
    import costs ~1.5 s): the fields `LlamaSpec.from_config`, the memory estimates and the drafters read, as
    transformers' `LlamaConfig` / `Qwen2Config` name them."""

    model_type = "llama"


class NativeGemmaConfig(PretrainedConfig):
    """A Gemma 3 text config without `transformers.models`: the fields `GemmaSpec.from_config` reads, as
    transformers' `Gemma3TextConfig` names them."""

    model_type = "gemma3_text"


@functools.cache
def native_config_class(model_type: str) -> type[NativeLlamaConfig]:
    """`NativeLlamaConfig` for another Llama-family model_type (Qwen2's): the same fields under its own name."""
    if model_type == NativeLlamaConfig.model_type:
        return NativeLlamaConfig
    return type(f"NativeLlamaConfig_{model_type}", (NativeLlamaConfig,), {"model_type": model_type})


_TOKEN_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
               "padding_token_id": "pad_token_id"}


def gguf_config(file: GGUFFile, name: str | None = None) -> NativeLlamaConfig | NativeGemmaConfig:
    """The config of a GGUF file's model, from its metadata by its architecture record (`architectures.py`: the
    fields transformers' conversion fills); `name_or_path` the name the model was asked for (default: the file's
    path), what `--draft-model auto` looks pairs up by. `architectures.Unknown` (an UnsupportedModel) where the
    table does not know the file's architecture, a metadata key or a tensor (rope scaling's among them)."""
    meta = file.metadata
    arch = file_architecture(file)
    fields = {field: meta[f"{arch.name}.{key}"] for key, field in arch.metadata.items() if f"{arch.name}.{key}" in meta}
    fields.update({field: meta[f"tokenizer.ggml.{key}"] for key, field in _TOKEN_KEYS.items()
                   if f"tokenizer.ggml.{key}" in meta})
    if "vocab_size" not in fields:
        fields["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    theta = float(fields.pop("rope_theta", 10000.0))
    fields["tie_word_embeddings"] = not any(t.name == "output.weight" for t in file.tensors)
    fields["rms_norm_eps"] = float(fields.get("rms_norm_eps", 1e-6))
    common = dict(name_or_path=name or str(file.path), dtype=torch.float32, architectures=[arch.hf_class])
    if arch.native == "llama":
        return native_config_class(arch.model_type)(hidden_act=arch.hidden_act, **common, **fields,
                                                     rope_parameters={"rope_type": "default", "rope_theta": theta})
    layers, pattern = fields["num_hidden_layers"], arch.config["sliding_window_pattern"]
    return NativeGemmaConfig(
        hidden_activation=arch.hidden_act, **common, **fields,
        # scores scaled by head_dim^-1/2, as llama.cpp scales them (transformers' conversion: its default 256, the
        # head dim of every Gemma 3 size but 27B, whose scalar is neither)
        query_pre_attn_scalar=fields["head_dim"],
        layer_types=[GLOBAL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)],
        rope_parameters={GLOBAL: {"rope_type": "default", "rope_theta": theta},
                         SLIDING: {"rope_type": "default", "rope_theta": arch.config["local_rope_theta"]}},
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
        if is_released(self):
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


def is_hf_model(obj) -> bool:
    """Whether obj is a Hugging Face model, without importing Hugging Face modeling (~1.5 s of start-up): where
    it was never imported, nothing is one."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(obj, modeling.PreTrainedModel)


def is_causal_lm(obj) -> bool:
    """Whether obj is a loaded causal LM (a Hugging Face model or a `NativeCausalLM`), not a drafter or a name."""
    return isinstance(obj, NativeCausalLM) or is_hf_model(obj)


def from_gguf(path: str | Path, max_len: int = 0, name: str | None = None, activations: str = "fp32",
              head_ids: torch.Tensor | None = None) -> NativeCausalLM:
    """A GGUF file's model on its own blocks (every type in quant.NATIVE_TYPES as stored, the rest float32): the
    values of the fp32 conversion transformers makes of the file, without making it. max_len: the rotary table's length at least
    (default: the model's context length); name: what the model was asked by (`gguf_config`). UnsupportedModel where
    `gguf_config` refuses the file, ValueError for a block type the kernel does not run. activations: what the
    blocks compute with (quant.py: 'fp32', or 'q8' integer activations). head_ids: [n] ascending token ids the LM
    head keeps (a compact `ReducedHead` of the file's own rows for them: a draft model's, whose drafter maps its
    logits to token ids; its config's `draft_vocab` lists them), or None: the whole head."""
    file = open_gguf(path)
    config = gguf_config(file, name)
    spec = model_spec(config, max_len)
    positions = table_positions(spec, config, max_len)
    with _one_thread():
        weights = read_gguf_weights(path, spec.num_heads, spec.num_kv_heads, activations)
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])  # tied: the embedding's blocks
        rows = None if head_ids is None else read_head_rows(path, head_ids, activations)
        if rows is not None:  # the head's other rows are never read
            weights["lm_head.weight"] = ReducedHead(rows, head_ids, config.vocab_size, compact=True)
            config.draft_vocab = head_ids.tolist()
        model = build_model(spec, weights, config, positions, pack=False)
    arch = file_architecture(file)
    shapes = {arch.hf_name(info.name): info.shape for info in file.tensors}
    stand_in = NativeCausalLM(config, {name: torch.empty(shape, device="meta") for name, shape in shapes.items()})
    adopt(stand_in, model)
    facts(stand_in).reduced_head = rows is not None
    return stand_in


_FOLDER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps",
                "vocab_size", "max_position_embeddings")


def folder_config(folder: Path) -> NativeLlamaConfig | None:
    """A model folder's config.json as a `NativeLlamaConfig`, where it is a plain Llama (every field `LlamaSpec` reads
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
    return NativeLlamaConfig.from_dict(fields) if plain else None


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
