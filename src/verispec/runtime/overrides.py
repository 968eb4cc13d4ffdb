"""Every environment variable verispec reads, listed here and read through `read` (at call time, never at import).

Behaviour is chosen by typed options (`config.RunnerOptions`, `runtime/model/target.TargetOptions`, the CLI's flags
and the server's config fill them). What remains here is of four kinds:
- **override**: a test or measurement override of a kernel's path (which of its same-bits implementations runs, for
  tests that compare them and recipes that time them side by side); a user never needs one;
- **location**: where files are kept;
- **secret**: the server's API key (`--api-key` defaults to it, so it need not appear in `ps`);
- **test**: switches of the test suite and CI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str  # override / location / secret / test
    what: str  # its values and what each does
    read_by: str  # the module that reads it (through `read`, or natively where it says so)


VARIABLES = {v.name: v for v in (
    Variable("VERISPEC_DENSE_PATH", "override", "the dense linear's path: vdpbf16ps, avx512, avx2, scalar, or off "
             "(oneDNN); unset: the best built for this CPU", "runtime/kernels/dense.py"),
    Variable("VERISPEC_QUANT_PATH", "override", "the quantized linear's path (kernels/paths.py names them)",
             "runtime/kernels/quant.py"),
    Variable("VERISPEC_ATTENTION_PATH", "override", "the fused attention's path: tiled, vector, scalar; unset or "
             "auto: tiled from fused.TILE_QUERIES fed tokens a row, else vector", "runtime/kernels/fused.py"),
    Variable("VERISPEC_LAYER_LOOP", "override", "python: every layer from Python, not the C++ loop (same bits)",
             "runtime/kernels/layer_loop.py"),
    Variable("VERISPEC_POOL", "override", "off: the kernels' parallel regions on OpenMP, not the work pool",
             "runtime/kernels/ext.py"),
    Variable("VERISPEC_POOL_SPIN_US", "override", "microseconds an idle pool thread spins before it sleeps",
             "runtime/kernels/pool.cpp (natively, when the pool starts)"),
    Variable("VERISPEC_POOL_CHUNKS", "override", "chunks per thread a pool region is cut into",
             "runtime/kernels/pool.cpp (natively, when the pool starts)"),
    Variable("VERISPEC_CACHE", "location", "verispec's cache folder (built kernels, compiled programs, joined "
             "model parts); default ~/.cache/verispec", "runtime/kernels/ext.py (`cache_root`)"),
    Variable("VERISPEC_PEERS_DIR", "location", "where `bench --peers` keeps peer engines; default "
             "~/.cache/verispec-peers", "bench/peers.py"),
    Variable("VERISPEC_BENCH_PROMPTS", "location", "the Spec-Bench question file `bench` reads", "bench/prompts.py"),
    Variable("VERISPEC_API_KEY", "secret", "the key `serve` requires (the default of --api-key)", "cli/serve.py"),
    Variable("VERISPEC_REQUIRE_KERNELS", "test", "1: a C++ kernel that does not build raises instead of leaving "
             "the torch fallback (make test, .ci/run)", "runtime/kernels/ext.py"),
    Variable("VERISPEC_TEST_RUNNER", "test", "hf, native or compiled: the whole suite on that runner (.ci/run)",
             "tests/conftest.py"),
    Variable("VERISPEC_REQUIRE_BROWSER", "test", "1: a missing browser fails the playground's browser test",
             "tests/server/test_playground_browser.py"),
)}


def read(name: str, default: str | None = None) -> str | None:
    """The variable's value now (`default` where unset or empty); `name` must be listed in VARIABLES."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of verispec's environment variables (runtime/overrides.py)")
    return os.environ.get(name) or default
