"""Building verispec's own models (`llama.LlamaModel`, `gemma.GemmaModel`) from weights by Hugging Face name:
`model_spec` (which model a config is, or UnsupportedModel), `rope_table` / `table_positions` (the rotary tables),
`build_model`, `load_safetensors` (straight from a folder), `weights_of` (a Hugging Face model's tensors)."""

from __future__ import annotations

from pathlib import Path

import torch

from .gemma import ARCHITECTURES as GEMMA, GemmaModel, GemmaSpec, rope_tables
from .llama import LlamaModel, LlamaSpec

NativeModel = LlamaModel | GemmaModel


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A Hugging Face causal LM's tensors by checkpoint name (the same names as its safetensors files)."""
    weights = {name: p.detach() for name, p in model.named_parameters()}
    if "lm_head.weight" not in weights:  # tied embeddings share one tensor
        weights["lm_head.weight"] = model.get_output_embeddings().weight.detach()
    return weights


def rope_table(model_or_config, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, head_dim] (float32, attention scaling applied) from the model's own rotary module; for a
    config alone, the default rope computed here as Hugging Face's rotary module computes it (the same operations,
    so the same bits; tested), other rope types by that module."""
    rotary = getattr(getattr(model_or_config, "model", None), "rotary_emb", None)
    if rotary is None:
        config = getattr(model_or_config, "config", model_or_config).get_text_config()
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
            return _default_rope(config, rope["rope_theta"], max_len)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rotary = LlamaRotaryEmbedding(config)
    probe = torch.zeros(1, dtype=torch.float32, device=rotary.inv_freq.device)
    cos, sin = rotary(probe, torch.arange(max_len, device=probe.device).unsqueeze(0))
    return cos[0].float(), sin[0].float()


def _default_rope(config, base: float, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The original rotary embedding: inverse frequencies base^(-2i/d), angles position x frequency, each once per
    half of the head (Hugging Face's default rope type, operation for operation)."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))  # [d / 2]
    freqs = torch.arange(max_len)[:, None].float() * inv_freq  # [max_len, d / 2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [max_len, d]
    return angles.cos(), angles.sin()


def model_spec(config, max_len: int) -> LlamaSpec | GemmaSpec:
    """The native spec of a config (Gemma 3 or the Llama family), or UnsupportedModel saying why it has none."""
    if getattr(config.get_text_config(), "model_type", None) in GEMMA:
        return GemmaSpec.from_config(config, max_len)
    return LlamaSpec.from_config(config, max_len)


def table_positions(spec: LlamaSpec | GemmaSpec, config, max_len: int) -> int:
    """How many positions a new native model's rotary tables cover: a Llama-family model's the whole context (its
    tables are fixed once built), a Gemma model's `max_len` (it has four tables, 134 MB at Gemma 3's 32k context
    in fp32; `GemmaModel.reserve_positions` grows them where a runner needs more)."""
    if isinstance(spec, GemmaSpec):
        return max_len
    return max(max_len, getattr(config.get_text_config(), "max_position_embeddings", 0) or 0)


def build_model(spec: LlamaSpec | GemmaSpec, weights: dict[str, torch.Tensor], model_or_config, positions: int,
                pack: bool = True, invariant: bool = False) -> NativeModel:
    """The native model of `spec` on weights (by Hugging Face name), its rotary tables `positions` long."""
    if isinstance(spec, GemmaSpec):
        return GemmaModel(spec, weights, rope_tables(spec, positions), pack=pack, invariant=invariant)
    return LlamaModel(spec, weights, rope_table(model_or_config, positions), pack=pack, invariant=invariant)


def load_safetensors(folder: str | Path, dtype: torch.dtype, max_len: int, device: str = "cpu",
                     pack: bool = True) -> NativeModel:
    """Build the native model straight from a Hugging Face folder (config.json + *.safetensors), no HF modeling."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    spec = model_spec(config, max_len)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update({k: v.to(device=device, dtype=dtype) for k, v in load_file(file).items()})
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
    return build_model(spec, weights, config, max_len, pack=pack)
