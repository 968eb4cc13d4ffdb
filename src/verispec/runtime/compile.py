"""The native model's whole step (`llama.model_forward`: embedding, every layer, the LM head) compiled as one
program per shape class, and cached on disk so that a later process compiles nothing.

Shape classes: Dynamo specialises sizes 0 and 1 and makes the rest dynamic, so a model compiles one program per
(one row / many rows) x (one fed token / many) x (logits wanted at one / many / all positions), the attended
length dynamic (the runner marks it): a decode step, a verify pass and a prefill chunk each compile once.

The cache: Inductor's FX graph cache and AOTAutograd cache under `~/.cache/verispec/compile/<key>`, the key
naming the torch version and the CPU's features (what generated code depends on); the model and dtype are part
of Inductor's own key for each graph. A second process re-traces the Python (seconds) and loads the compiled
code instead of generating and building it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from .dtype import cpu_flags

logger = logging.getLogger("verispec")

_COMPILED = None


def cache_dir() -> Path:
    """~/.cache/verispec/compile/<torch version>-<hash of the CPU flags> ($VERISPEC_CACHE overrides the root)."""
    root = Path(os.environ.get("VERISPEC_CACHE", Path.home() / ".cache" / "verispec"))
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return root / "compile" / f"torch-{torch.__version__}-cpu-{flags}"


def use_disk_cache() -> Path:
    """Point Inductor's caches at verispec's folder (unless the user set TORCHINDUCTOR_CACHE_DIR) -> the folder.

    Importing torch._dynamo writes Inductor's default (/tmp/torchinductor_<user>) into TORCHINDUCTOR_CACHE_DIR, so
    a value equal to that default is taken as unset; Inductor reads the variable at each cache lookup."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not given or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())
    folder = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return folder


def compiled_forward(model_forward):
    """`model_forward` (`llama.model_forward`, passed in: this module sits below the model) under torch.compile
    (Inductor), made once per process; it serves every model (the weights are inputs, so a target and its draft
    share it, each with its own specialisations)."""
    global _COMPILED
    if _COMPILED is None:
        folder = use_disk_cache()
        logger.info("native runner: the whole step compiled per shape class, cached in %s", folder)
        # A target and its draft, each at 1 or many rows and tokens, and the test suite's many tiny models: more
        # specialisations than Dynamo's default 8, past which it would silently run eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _COMPILED = torch.compile(model_forward, dynamic=None)
    return _COMPILED


def cache_counts() -> dict[str, int]:
    """This process's Inductor FX graph cache hits and misses so far (a graph loaded vs generated and built)."""
    from torch._dynamo.utils import counters

    return {"hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"]}
