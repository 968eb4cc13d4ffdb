"""The draft (student) model: a small Llama sharing the target's tokenizer, and its export as an HF folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM


def draft_config(target_config, hidden_size: int, num_layers: int, intermediate_size: int, num_heads: int,
                 num_kv_heads: int, max_positions: int) -> LlamaConfig:
    """A Llama config for the draft: the target's vocabulary and special ids, the draft's own (small) shape."""
    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": _rope_theta(target_config)},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=getattr(target_config, "bos_token_id", None),
        eos_token_id=getattr(target_config, "eos_token_id", None),
        pad_token_id=getattr(target_config, "pad_token_id", None),
        initializer_range=0.02,
    )


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def build_draft(target, config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """A freshly initialised draft whose (tied) embedding table is the target's projected on its top principal axes.

    Projecting keeps the geometry of the target's token space (which tokens are alike), so the draft starts from
    a sensible input embedding and output head rather than from noise.
    """
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(config)
    table = target.get_input_embeddings().weight.detach().float()  # [vocab, target_hidden]
    draft.get_input_embeddings().weight.data.copy_(pca_embeddings(table, config.hidden_size))
    draft.tie_weights()
    return draft


def pca_embeddings(table: torch.Tensor, dim: int) -> torch.Tensor:
    """Project `table` [vocab, d] on its top-`dim` principal axes -> [vocab, dim], rescaled to std 0.02-ish rows."""
    centered = table - table.mean(0, keepdim=True)
    if dim >= table.shape[1]:
        projected = torch.nn.functional.pad(centered, (0, dim - table.shape[1]))
    else:
        _, _, v = torch.pca_lowrank(centered, q=dim, center=False, niter=4)  # v: [d, dim]
        projected = centered @ v
    return projected * (0.02 * dim ** 0.5 / projected.norm(dim=1).mean().clamp(min=1e-8))


def export_draft(draft: LlamaForCausalLM, tokenizer, out_dir: Path, dtype: torch.dtype, recipe: dict,
                 generation_config: GenerationConfig | None) -> Path:
    """Write the draft as a Hugging Face folder: config, safetensors in `dtype`, tokenizer, generation config, and
    `distill_recipe.json` (the exact settings that produced it)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = LlamaForCausalLM(draft.config)
    model.load_state_dict(draft.state_dict())
    model.to(dtype)
    model.config.dtype = dtype
    if generation_config is not None:
        model.generation_config = generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "distill_recipe.json").write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    return out_dir
