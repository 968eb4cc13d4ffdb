"""The target's weights, decided in one place: `resolve_target(TargetOptions, target) -> TargetPlan` (weights, dtype,
activations, each with its reason, decided once; the generator, the CLI, the server and the bench call it and log
`plan.describe()`; `plan.load()` loads it). Its parts: `--weights` (`resolve_weights`: 'auto' is a GGUF target's own blocks
where they run, else the float conversion, and why), `--quantization`, what runs on them (`check_weights`), the dtype
they compute in (`resolve_target_dtype`), and the target loaded on them (`load_target`: what the CLI, the server,
the benchmark and `SpeculativeGenerator.from_pretrained` call; `quantize_target` for a model already loaded).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .loading import (ModelLoadError, float_dtype, in_native_family, load_model, resolve_model_path,
                      target_gguf_file)

WEIGHTS = ("auto", "fp32", "gguf")  # --weights: a GGUF target's own blocks where they run (auto), the float
# conversion (fp32), or the GGUF blocks (gguf)
QUANTIZATIONS = ("none", "int8")  # --quantization: weight-only int8 per output channel (a different model)
ACTIVATIONS = ("auto", "q8", "fp32")  # --activations: what GGUF blocks compute with (kernels/quant.py)
AUTO_ACTIVATIONS = "q8"  # what 'auto' picks for GGUF blocks where the kernel runs it (measured: docs/runner.md)


logger = logging.getLogger("verispec")


@dataclass(frozen=True)
class TargetOptions:
    """What was asked of the target (the CLI's flags, the server's options, `from_pretrained`'s keywords)."""

    weights: str = "auto"  # WEIGHTS
    quantization: str = "none"  # QUANTIZATIONS
    dtype: str | torch.dtype = "auto"
    activations: str = "auto"  # ACTIVATIONS
    device: str = "cpu"
    runner: str = "auto"  # the runner backend: auto / native / hf
    compile: bool = False
    drafter_reads_weights: bool = False  # a draft head or twin reads the target's float weights
    hf_methods: bool = False  # Hugging Face runs the target too (the bench's HF methods)


@dataclass(frozen=True)
class TargetPlan:
    """The target as it will load: every choice resolved once, with why (`describe`)."""

    target: str
    weights: str  # 'gguf' or 'fp32'
    dtype: torch.dtype
    activations: str  # 'q8' or 'fp32'
    quantization: str
    device: str
    reasons: dict[str, str] = field(default_factory=dict)  # weights / activations / dtype -> why

    def describe(self) -> str:
        return "; ".join(f"{what} {self.reasons[what]}" for what in ("weights", "activations", "dtype"))

    def load(self):
        """The target model on this plan (`load_target`)."""
        return load_target(self.target, self.weights, self.quantization, dtype=self.dtype, device=self.device,
                           activations=self.activations)


def resolve_target(options: TargetOptions, target: str | os.PathLike) -> TargetPlan:
    """Every choice about the target made once, in order: the weights (`resolve_weights`), the dtype they compute in
    (`resolve_target_dtype`), the activations GGUF blocks compute with (`resolve_activations`); the combination
    checked (`check_weights`). ValueError naming the fix for a value or combination that does not run."""
    o = options
    weights, weights_why = resolve_weights(o.weights, target, o.dtype, o.device, o.quantization, o.runner,
                                           o.hf_methods, o.drafter_reads_weights, o.compile)
    dtype, dtype_why = resolve_target_dtype(o.dtype, o.device, target, weights, o.quantization, o.runner)
    activations, activations_why = resolve_activations(o.activations, weights)
    if weights != "fp32" or o.quantization != "none":
        try:
            check_weights(target, weights, o.quantization, dtype)
        except ModelLoadError:  # the combination is fine; the model is not found: loading says so
            pass
    return TargetPlan(str(target), weights, dtype, activations, o.quantization, str(o.device),
                      {"weights": weights_why, "activations": activations_why, "dtype": dtype_why})


def resolve_target_dtype(dtype: str | torch.dtype, device: str | torch.device, target: str | os.PathLike,
                         weights: str = "fp32", quantization: str = "none", runner: str = "auto"):
    """`runtime/model/dtype.resolve_dtype` for this target: 'auto' is float32 on quantized weights, else as for any
    model on float weights (`loading.float_dtype`). -> (dtype, why)."""
    from .dtype import resolve_dtype

    if weights == "auto":
        weights, _ = resolve_weights(weights, target, dtype, device, quantization, runner)
    if not is_quantized(weights, quantization):
        return float_dtype(dtype, device, target, runner)
    return resolve_dtype(dtype, device, True, True)


def resolve_weights(weights: str, target: str | os.PathLike, dtype: str | torch.dtype = "auto",
                    device: str | torch.device = "cpu", quantization: str = "none", runner: str = "auto",
                    hf_methods: bool = False, drafter_reads_weights: bool = False,
                    compile: bool | None = False) -> tuple[str, str]:
    """`--weights auto` -> 'gguf' or 'fp32', and why: a GGUF target (the embedded default is one) runs its own
    blocks where verispec's GGUF kernel runs them (CPU, native runner, block types it has, the kernel built) and
    nothing asked for the float conversion (an explicit --dtype, --quantization, Hugging Face runs, a draft head or
    twin, which read the target's float weights: `drafter_reads_weights`, --compile, whose programs take float
    weights); the values are those of the fp32 conversion, at a quarter of the bytes (docs/runner.md). 'fp32' /
    'gguf' are kept. ValueError naming the choices for an unknown value."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}: choose from {', '.join(WEIGHTS)}")
    if weights != "auto":
        return weights, f"{weights}: asked for"
    why = "fp32 (the float conversion): "
    if quantization != "none":
        return "fp32", why + f"--quantization {quantization} quantizes the float conversion"
    if not (isinstance(dtype, str) and dtype == "auto"):
        return "fp32", why + f"the dtype was asked for ({str(dtype).removeprefix('torch.')})"
    if torch.device(device).type != "cpu":
        return "fp32", why + "the GGUF kernel runs on the CPU only"
    if drafter_reads_weights:
        return "fp32", why + "the drafter (a draft head or the twin) reads the target's float weights"
    if compile:
        return "fp32", why + "--compile compiles float weights (the GGUF blocks run eager only)"
    try:
        gguf_file = target_gguf_file(target)
    except (ValueError, ModelLoadError):  # not found: loading reports it
        return "fp32", why + "the target's file could not be read"
    if gguf_file is None:
        return "fp32", why + "the target is not a GGUF file"
    from ..kernels import quant
    from ..weights.gguf_file import open_gguf
    from .architectures import Unknown
    from .gguf_weights import file_architecture, unsupported_types

    try:
        file_architecture(open_gguf(gguf_file))
    except Unknown as exc:
        return "fp32", why + f"{exc}: its blocks are not built, never on a guessed layout"
    if hf_methods or not in_native_family(target, runner):
        return "fp32", why + "Hugging Face modeling runs the target, which has no GGUF kernel"
    runs, other = unsupported_types(gguf_file)
    if other:
        return "fp32", why + f"the GGUF file holds {', '.join(other)} blocks, which the GGUF kernel does not run"
    if quant.kernel() is None:
        return "fp32", why + "the GGUF kernel is not built here (no C++ compiler?)"
    return "gguf", (f"gguf: the target's GGUF file as stored ({', '.join(runs) or 'float'} blocks, every one run "
                    "natively, on fp32 or integer activations): the fp32 conversion's weight values at a fraction of the "
                    "bytes (--weights fp32 runs the conversion)")


def resolve_activations(activations: str, weights: str) -> tuple[str, str]:
    """`--activations` for the resolved weights -> ('q8' or 'fp32', why). On GGUF blocks 'auto' is AUTO_ACTIVATIONS
    where the kernel is built: 'q8' computes as llama.cpp does (activations to int8 per block of 32, exact integer
    dot products: a verify pass, a batch and a prefill cost close to one step), another model than the fp32
    conversion (its quality measured in docs/runner.md); 'fp32' keeps the conversion's values exactly. Float weights
    have no integer path. ValueError naming the choices for an unknown value or 'q8' on float weights."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"unknown activations {activations!r}: choose from {', '.join(ACTIVATIONS)}")
    if weights != "gguf":
        if activations == "q8":
            raise ValueError("--activations q8 runs GGUF blocks: pass --weights gguf (or auto), or --activations fp32")
        return "fp32", "fp32: the weights are float (integer activations run GGUF blocks only)"
    if activations != "auto":
        return activations, f"{activations}: asked for"
    from ..kernels import quant

    if quant.kernel() is None:
        return "fp32", "fp32: the quant kernel is not built here"
    if AUTO_ACTIVATIONS == "fp32":
        return "fp32", "fp32: the fp32 conversion's values (--activations q8: integer activations, faster wide)"
    return "q8", ("q8: the GGUF blocks' integer arithmetic (activations to int8 per block of 32, as llama.cpp): "
                  "verify passes, batches and prefill cost close to one step; --activations fp32 keeps the fp32 "
                  "conversion's values")


def is_quantized(weights: str, quantization: str) -> bool:
    """Whether --weights / --quantization put the target on quantized weights (which compute in float32)."""
    return weights == "gguf" or quantization != "none"


def check_weights(name_or_path: str | os.PathLike, weights: str, quantization: str, dtype: torch.dtype) -> Path | None:
    """--weights / --quantization checked against the target; -> its GGUF file for `--weights gguf`, else None.
    ValueError naming the fix for a combination that does not run."""
    if weights not in WEIGHTS or weights == "auto":  # 'auto' is resolved first (resolve_weights)
        raise ValueError(f"unknown weights {weights!r}: choose from {', '.join(WEIGHTS[1:])}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}: choose from {', '.join(QUANTIZATIONS)}")
    if weights == "fp32" and quantization == "none":
        return None
    if weights == "gguf" and quantization != "none":
        raise ValueError("--weights gguf runs the file's own quantization: leave --quantization none")
    if dtype != torch.float32:
        raise ValueError(f"quantized weights compute in float32, not {dtype}: pass --dtype float32")
    if weights == "fp32":
        return None
    path = target_gguf_file(name_or_path)
    if path is None:
        raise ValueError(f"--weights gguf needs a .gguf target (or the embedded default), not "
                         f"{resolve_model_path(name_or_path)}")
    return path


def quantize_target(model, name_or_path: str | os.PathLike, weights: str = "fp32", quantization: str = "none",
                    activations: str = "fp32"):
    """The loaded target on quantized weights (runtime/kernels/quant.py), in place: `weights="gguf"` its GGUF file's own
    blocks (the same values as the fp32 conversion), `quantization="int8"` its linears per channel. Afterwards only
    the native runner runs it. -> model."""
    from ..model.twins import use_quantized_weights

    gguf_file = check_weights(name_or_path, weights, quantization, next(model.parameters()).dtype)
    if gguf_file is not None or quantization != "none":
        use_quantized_weights(model, 0, gguf_file=gguf_file, quantization=quantization, activations=activations)
    return model


def load_target(name_or_path: str | os.PathLike, weights: str = "fp32", quantization: str = "none",
                dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu", activations: str = "fp32"):
    """The target on the weights `resolve_weights` chose (`check_weights`' rules): `weights="gguf"` on the CPU builds
    the model straight from the file's blocks (`native_lm.from_gguf`: no float conversion, no Hugging Face
    modeling; a `NativeCausalLM` that only the native runner runs), where its architecture allows; otherwise the
    float model (`load_model`) on the weights `quantize_target` gives it. The same values either way. activations:
    what GGUF blocks compute with ('fp32' or 'q8': `resolve_activations`). -> model."""
    activations, _ = resolve_activations(activations, weights)
    dtype, _ = resolve_target_dtype(dtype, device, name_or_path, weights, quantization)
    if weights == "gguf" and quantization == "none" and torch.device(device).type == "cpu":
        from .architectures import Unknown, UnsupportedModel
        from .native_lm import from_gguf

        try:
            return from_gguf(check_weights(name_or_path, weights, quantization, dtype), name=str(name_or_path),
                             activations=activations)
        except Unknown:  # the table does not know the file: its blocks are never read on a guessed layout
            raise
        except UnsupportedModel as exc:  # a config the native model does not build: through the conversion, said
            logger.warning("%s: %s; loading it through Hugging Face's fp32 conversion instead (slower start, more "
                           "memory)", name_or_path, exc)
    return quantize_target(load_model(name_or_path, dtype=dtype, device=device), name_or_path, weights, quantization,
                           activations)
