"""The compiled step's disk cache across processes: a second process with the same model and cache folder loads
the program the first saved (no trace, no compile) and computes the same logits; a program saved for another
model's shapes is refused by its guards and compiled again. Gated on the programs' load / compile counters, never
on time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verispec.runtime.kernels.ext import cache_root

# One process: a 1-layer tiny llama, one decode step compiled (one shape class), its logits and cache counters.
CHILD = """
import json
import torch
from conftest import tiny_llama
from verispec.runtime.runners.native import NativeRunner
from verispec.runtime.runners.select import runner_info

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
    assert first["cache"]["programs_compiled"] == 1 and first["cache"]["programs_loaded"] == 0
    # under VERISPEC_CACHE, keyed by torch version and CPU flags
    assert len(list((tmp_path / "compile").glob("*/programs/*.bin"))) == 1
    second = run_child(tmp_path)
    assert second["cache"]["programs_loaded"] == 1 and second["cache"]["programs_compiled"] == 0
    assert torch.equal(torch.tensor(second["logits"]), torch.tensor(first["logits"]))
    # a damaged program file is compiled again and replaced, with the same logits
    saved = next((tmp_path / "compile").glob("*/programs/*.bin"))
    saved.write_bytes(b"not a program")
    third = run_child(tmp_path)
    assert third["cache"]["programs_loaded"] == 0 and third["cache"]["programs_compiled"] == 1
    assert saved.read_bytes() != b"not a program"
    assert torch.equal(torch.tensor(third["logits"]), torch.tensor(first["logits"]))
