"""The native twin of a loaded model: the one `NativeModel` that every native runner on it runs (engines, drafters,
benchmark methods), built once from its weights (`twin`), or adopted (`adopt`: a model whose only weights are the
native model's, `native_lm.from_gguf`'s); `use_quantized_weights` puts it on quantized blocks; `release_hf_weights`
frees Hugging Face's copies once the twin holds its own. What verispec decided about a loaded model is kept here too,
beside the model rather than on it (`ModelFacts`, read through `facts`)."""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from .build import NativeModel, build_model, model_spec, table_positions, weights_of
from .gemma import GemmaModel

_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF model -> (its native model, weights fingerprint)


@dataclass
class ModelFacts:
    """What verispec decided about a loaded model (a Hugging Face model or `NativeCausalLM`), kept by this registry
    for as long as the model lives; the model object itself carries nothing of verispec's."""

    released: bool = False
    """Its weights are its native twin's only (HF's copies are meta tensors or were freed): only native runners
    run it, and nothing can read its float weights (a twin drafter, HF modeling)."""
    weight_bytes: int | None = None
    """What a step reads once released: quantized blocks as stored, the rest as held (None: its parameters')."""
    draft_weights: str | None = None
    """What its linears run as where it drafts ('Q8_0', 'gguf (... activations)'); None: as loaded (float)."""
    reduced_head: bool = False
    """Its native twin's LM head computes only the draft vocabulary's rows (drafters/twin_head.py)."""


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ModelFacts


def facts(model) -> ModelFacts:
    """`model`'s record (a fresh one, kept, the first time: nothing decided yet)."""
    record = _FACTS.get(model)
    if record is None:
        record = _FACTS[model] = ModelFacts()
    return record


def is_released(model) -> bool:
    """Whether `model`'s weights were released to its native twin (`ModelFacts.released`)."""
    record = _FACTS.get(model)
    return record is not None and record.released


def twin(hf_model, max_len: int, invariant: bool = False) -> NativeModel:
    """The shared native copy of hf_model's weights. A copy: rebuilt when the HF weights were replaced or changed
    in place (training) since, or built for the other `invariant` layout, unless they were released to it (then it
    is the only copy left)."""
    spec = model_spec(hf_model.config, max_len)
    if is_released(hf_model):
        model = _TWINS[hf_model][0]
        if model.invariant != invariant and model.lm_head.packed is True:  # (oneDNN's layout; others: one for both)
            raise ValueError(f"this model's weights were released to a native model with batch_invariant="
                             f"{model.invariant}: build every runner on it with the same batch_invariant")
        if model.cos.shape[0] < max_len and isinstance(model, GemmaModel):
            model.reserve_positions(max_len)
        if model.cos.shape[0] < max_len:
            raise ValueError(f"max_len {max_len} exceeds the native model's rotary table ({model.cos.shape[0]})")
        return model
    fingerprint = _fingerprint(hf_model)
    model, seen = _TWINS.get(hf_model, (None, None))
    other_layout = model is not None and model.invariant != invariant and model.lm_head.packed is True
    if model is None or seen != fingerprint or model.cos.shape[0] < max_len or other_layout:
        positions = table_positions(spec, hf_model.config, max_len)
        model = build_model(spec, weights_of(hf_model), hf_model, positions, invariant=invariant)
        _TWINS[hf_model] = (model, fingerprint)
    return model


def _fingerprint(hf_model) -> tuple:
    """Where hf_model's weights are and their versions: a twin built from them is stale once this changes."""
    return tuple((p.data_ptr(), p._version) for p in hf_model.parameters())


def native_twin_of(hf_model) -> NativeModel | None:
    """The native model already built for hf_model (shared by its native runners), or None when none was built."""
    entry = _TWINS.get(hf_model)
    return None if entry is None else entry[0]


def model_device(hf_model) -> torch.device:
    """Where hf_model's weights are: its native twin's device once they were released to it (HF's copies are then
    meta tensors), else its parameters'."""
    twin = native_twin_of(hf_model) if is_released(hf_model) else None
    return twin.cos.device if twin is not None else next(hf_model.parameters()).device


def use_quantized_weights(hf_model, max_len: int, gguf_file: str | Path | None = None,
                          quantization: str | None = None, release: bool = True,
                          activations: str = "fp32") -> NativeModel:
    """hf_model's native twin on quantized weights (runtime/kernels/quant.py), and HF's own copies released: the GGUF file's
    weights as stored (`--weights gguf`: the same values as the fp32 conversion hf_model was loaded from), or the
    twin's linears quantized (`--quantization int8`: a different model than the original). -> the twin.
    Afterwards hf_model holds no weights (meta tensors of the same shapes): only native runners run it. With
    release=False HF keeps its float weights (a draft model that HF's own assisted generation may also run).
    activations: what GGUF blocks compute with (quant.py: 'fp32', or 'q8' integer activations)."""
    from ..model.gguf_weights import read_gguf_weights
    from ..kernels.quant import quantize_linears

    spec = model_spec(hf_model.config, max_len)
    positions = table_positions(spec, hf_model.config, max_len)
    if gguf_file is not None:  # hf_model is this file's fp32 conversion: the same config
        weights = read_gguf_weights(gguf_file, spec.num_heads, spec.num_kv_heads, activations)
        weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])  # tied: the embedding's blocks
    else:
        weights = quantize_linears(weights_of(hf_model), quantization, activations)
    model = build_model(spec, weights, hf_model, positions, pack=False)
    if not release:
        _TWINS[hf_model] = (model, _fingerprint(hf_model))
        return model
    # HF's copies go (the twin is now the model), their shapes stay: vocabulary checks read them.
    for module in hf_model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.detach().to("meta"), requires_grad=False))
    adopt(hf_model, model)
    gc.collect()
    return model


def adopt(hf_model, model: NativeModel) -> None:
    """Make `model` the native twin and only copy of `hf_model`'s weights (which are meta tensors, or were released):
    every runner built on hf_model runs `model`, none runs Hugging Face modeling."""
    _TWINS[hf_model] = (model, None)
    record = facts(hf_model)
    record.released = True
    record.weight_bytes = sum(  # what a step reads: quantized blocks as stored, the rest as held
        w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()
        for w in {id(w): w for w in _model_weights(model)}.values())


def _model_weights(model: NativeModel) -> list:
    weights = [model.embed, model.norm, model.lm_head.weight]
    for layer in model.layers:
        weights += [w for w in layer.weights() if w is not None]
    return weights


def release_hf_weights(hf_model) -> int:
    """Free the Hugging Face copies of the weights the native twin holds in its own form (fused, packed, or copied:
    the twin aliases nothing), so a served model takes about its weights' size once, not twice; -> bytes freed.
    Afterwards only native runners can run this model object (make_runner with backend "hf" raises). Call it once
    every runner is built."""
    if hf_model not in _TWINS or is_released(hf_model):
        return 0
    freed, seen = 0, set()
    for module in hf_model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.numel():
                if param.data_ptr() not in seen:  # tied weights count once
                    seen.add(param.data_ptr())
                    freed += param.numel() * param.element_size()
                setattr(module, name, torch.nn.Parameter(param.new_empty(0), requires_grad=False))
    facts(hf_model).released = True
    gc.collect()  # the last reference to a memory-mapped checkpoint goes: its pages leave the process
    return freed
