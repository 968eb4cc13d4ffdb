"""The files each peer engine runs for a benchmark's target and draft, and what its weights are.

vLLM runs Hugging Face folders in the run's dtype (the embedded default: the converted fp32 folder, the same
weights verispec loads). llama.cpp runs the target's GGUF file as it ships (the embedded default: Q4_1 layers, a
Q8_0 embedding that is also the LM head) and the draft model converted to GGUF (`gguf_draft.py`).
"""

from __future__ import annotations

from pathlib import Path


def _draft_folder(config) -> Path | None:
    from ..drafters.spec import parse_drafter_spec
    from ..runtime.model.loading import resolve_model_path

    name = parse_drafter_spec(config.draft).model if config.draft else None
    return None if name is None else resolve_model_path(name)


def vllm_models(config, dtype: str) -> tuple[dict, str, list[str]]:
    """-> (the driver's model fields, the weights' description, notes)."""
    import torch

    from ..runtime.model.memory import weights_bytes
    from ..runtime.model.loading import resolve_model_path

    target = resolve_model_path(config.target)
    if target.suffix == ".gguf":
        raise ValueError(f"vLLM runs Hugging Face folders here and the target {config.target} is a GGUF file")
    models, notes = {"model": str(target)}, []
    weights = weights_bytes(target, getattr(torch, dtype))  # what vLLM holds: the folder's tensors in its dtype
    if weights:
        models["weights_bytes"] = weights
    draft = _draft_folder(config)
    if draft is None:
        notes.append("vllm draft model: not run (the benchmark has no draft model)")
    elif draft.suffix == ".gguf":
        notes.append(f"vllm draft model: not run (the draft {draft} is a GGUF file)")
    else:
        models["draft_model"] = str(draft)
    return models, dtype, notes


def target_gguf(config) -> Path:
    """The target's GGUF file: the embedded default's own, or a .gguf the user named."""
    from ..runtime.model.loading import DEFAULT_TARGET, embedded_gguf_path, resolve_model_path

    if config.target == DEFAULT_TARGET:
        return embedded_gguf_path()
    path = resolve_model_path(config.target)
    if path.suffix != ".gguf":
        raise ValueError(f"llama.cpp runs GGUF files and the target {config.target} is not one: pass a .gguf "
                         "target (or the embedded default) to compare with llama.cpp")
    return path


def gguf_weights(path: Path) -> tuple[str, int]:
    """-> ('GGUF Q4_1/Q8_0/F32': tensor types by bytes, largest first; the bytes of all tensors)."""
    import gguf

    by_type: dict[str, int] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        by_type[tensor.tensor_type.name] = by_type.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    kinds = sorted(by_type, key=by_type.get, reverse=True)
    return "GGUF " + "/".join(kinds), sum(by_type.values())


def llamacpp_models(config) -> tuple[dict, str, list[str]]:
    """-> (the driver's model fields, the weights' description, notes); the draft is converted to GGUF once."""
    from ..runtime.model.loading import cache_root
    from .gguf_draft import cached_draft_gguf

    gguf_file = target_gguf(config)
    weights, weight_bytes = gguf_weights(gguf_file)
    models, notes = {"gguf": str(gguf_file), "weights_bytes": weight_bytes}, []
    draft = _draft_folder(config)
    if draft is None:
        notes.append("llama.cpp draft model: not run (the benchmark has no draft model)")
    elif draft.suffix == ".gguf":
        models["draft_gguf"] = str(draft)
    else:
        try:
            models["draft_gguf"] = str(cached_draft_gguf(draft, gguf_file, cache_root() / "peers"))
        except (ValueError, KeyError, OSError) as exc:
            notes.append(f"llama.cpp draft model: not run (the draft {draft} does not convert to GGUF: {exc})")
    return models, weights, notes
