"""The compiled step's disk cache across processes: a second process with the same model and cache folder loads
the compiled graph Inductor wrote for the first (a cache hit) instead of generating it, and computes the same
logits. Gated on Inductor's own hit and miss counters, never on time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verispec.runtime.ext import cache_root

# One process: a 1-layer tiny llama, one decode step compiled (one shape class), its logits and cache counters.
CHILD = """
import json
import torch
from conftest import tiny_llama
from verispec.runtime.native import NativeRunner
from verispec.runtime.runner import runner_info

runner = NativeRunner.from_hf(tiny_llama(0, layers=1), 16, 1, compile=True)
logits = runner.forward(torch.tensor([[5]])).logits  # [1, 1, vocab]
info = runner_info(runner)
print(json.dumps({"cache": info["compile_cache"], "logits": logits.flatten().tolist()}))
"""


def run_child(cache_root: Path) -> dict:
    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "VERISPEC_CACHE": str(cache_root),
           "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # verispec's folder under VERISPEC_CACHE, not a user's choice
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=1800, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two processes compile (~1.5 min on 2 cores): .ci/run runs it beside the compiled runner's tests
def test_a_second_process_loads_the_compiled_step_from_disk(tmp_path):
    # The C++ kernels stay where they are built (a fresh cache root would rebuild them: minutes); only the compiled
    # graphs go to the new folder.
    (tmp_path / "ext").symlink_to(cache_root() / "ext", target_is_directory=True)
    first = run_child(tmp_path)
    assert first["cache"]["misses"] >= 1 and first["cache"]["hits"] == 0  # generated and written
    assert list((tmp_path / "compile").iterdir())  # under VERISPEC_CACHE, keyed by torch version and CPU flags
    second = run_child(tmp_path)
    assert second["cache"]["misses"] == 0 and second["cache"]["hits"] == first["cache"]["misses"]
    assert torch.equal(torch.tensor(second["logits"]), torch.tensor(first["logits"]))
