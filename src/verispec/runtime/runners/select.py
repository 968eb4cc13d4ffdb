"""Which runner runs a model: `make_runner` picks the native Llama-family runner (native.py) where it applies and
the Hugging Face runner (hf.py) otherwise; `runner_info` describes the pick. The runner classes are
re-exported here, so callers import runners from one place."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ...config import RunnerOptions
from .base import RunnerOutput, SlotRunner
from ..model.compile import cache_counts
from ..model.dtype import choose_dtype, dtype_name, kernels_built
from .hf import HFRunner
from ..model.architectures import UnsupportedModel
from ..model.twins import is_released, model_device
from .native import NativeRunner, default_compile

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["DEFAULT_OPTIONS", "HFRunner", "NativeRunner", "RunnerOutput", "SlotRunner", "make_runner",
           "runner_info"]

logger = logging.getLogger("verispec")


def runner_info(runner) -> dict:
    """What runs a model, for --json output and benchmark reports."""
    auto, why = choose_dtype(runner.device)
    info = {"backend": runner.backend, "compiled": runner.compiled, "compile_s": round(runner.compile_s, 2),
            "dtype": dtype_name(runner.dtype), "device": str(runner.device),
            "dtype_auto": dtype_name(auto), "dtype_auto_reason": why}
    if runner.compiled:  # the process's Inductor graphs loaded from / written to the disk cache (compile.py)
        info["compile_cache"] = cache_counts()
    if runner.backend == "native":
        info["packed_weights"] = runner.model.layers[0].packed
        info["batch_invariant"] = runner.batch_invariant
        info["kv_cache_dtype"] = dtype_name(runner.kv_dtype)
        info["kv_cache_dtype_reason"] = runner.kv_dtype_reason
    return info


# The options of runners built without explicit ones (the test suite sets it to run everything on each runner).
DEFAULT_OPTIONS = RunnerOptions()


def make_runner(model: PreTrainedModel, max_len: int, num_slots: int = 1, options: RunnerOptions | None = None):
    """The runner for `model`: the native Llama-family runner where it applies (backend "auto" or "native"),
    Hugging Face modeling otherwise. backend="native" on a model outside the family is the caller's error."""
    from ..model.native_lm import NativeCausalLM

    options = options or DEFAULT_OPTIONS
    if options.backend == "hf" and isinstance(model, NativeCausalLM):
        model = model.hf_model()  # Hugging Face modeling on the same weights (ValueError where it has none)
    if options.backend == "hf" and is_released(model):
        raise ValueError("this model's Hugging Face weights were released to the native runner "
                         "(twins.release_hf_weights): use the runner backend 'auto' or 'native', or load it again")
    if options.backend != "hf":
        try:
            compile = default_compile(model) if options.compile is None else options.compile
            invariant = options.batch_invariant
            if invariant is None:  # on where verispec's C++ kernels run: free there (config.RunnerOptions)
                invariant = model_device(model).type == "cpu" and kernels_built()
            runner = NativeRunner.from_hf(model, max_len, num_slots, compile=compile, batch_invariant=invariant,
                                          kv_cache_dtype=options.kv_cache_dtype, sliding_ring=options.sliding_ring)
            if runner.kv_dtype != runner.dtype:
                logger.info("native runner: KV cache %s", runner.kv_dtype_reason)
            return runner
        except UnsupportedModel as exc:
            if options.backend == "native":
                raise ValueError(f"the native runner cannot run this model: {exc}; use the runner backend "
                                 f"'hf' or 'auto'") from exc
            logger.info("native runner not used (%s): Hugging Face modeling runs this model", exc)
    return HFRunner(model.hf_model() if isinstance(model, NativeCausalLM) else model, max_len, num_slots)
