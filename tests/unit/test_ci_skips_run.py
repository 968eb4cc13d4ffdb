"""pytest itself under CI=true with the suite's skip rule (tests/ci_skips.py, the plugin tests/conftest.py takes):
a skip that is not the machine's fails the run (a test skipped by a mark, by pytest.skip, a module by
importorskip); one for what the machine lacks stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

DEMO = '''
import pytest
from ci_skips import machine_reason

def test_passes():
    pass

def test_skipped_for_a_package():
    pytest.skip("a package is missing")

@pytest.mark.skipif(True, reason="not the machine")
def test_skipped_by_a_mark():
    pass

@pytest.mark.skipif(True, reason=machine_reason("needs a CUDA device"))
def test_skipped_for_the_machine():
    pass
'''


def test_a_run_with_a_skip_that_is_not_the_machines_fails_where_ci_is_set(tmp_path):
    (tmp_path / "test_demo.py").write_text(DEMO)
    (tmp_path / "test_module_skipped.py").write_text('import pytest\npytest.importorskip("no_such_module")\n')
    env = {**os.environ, "CI": "true", "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "ci_skips", "-p", "no:cacheprovider", "-rA",
                          "--continue-on-collection-errors", "-c", os.devnull, "--rootdir", str(tmp_path),
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    out = run.stdout
    assert "FAILED test_demo.py::test_skipped_for_a_package - skipped where CI is set (a package is missing)" in out
    assert "ERROR test_demo.py::test_skipped_by_a_mark - skipped where CI is set (not the machine)" in out
    assert "ERROR test_module_skipped.py - skipped where CI is set (could not import 'no_such_module'" in out
    assert "SKIPPED [1] test_demo.py:15: this machine: needs a CUDA device" in out
    assert "1 failed, 1 passed, 1 skipped, 2 errors" in out and run.returncode == 1, out
