"""A `verispec generate` start in a fresh interpreter: which heavy modules it imported and the `startup_s` its
--json reports (what keeps a start short: docs/runner.md, "Start-up")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY = ("transformers.modeling_utils", "transformers.models")  # Hugging Face modeling, ~1.5 s to import


def start_report(generate_args: list[str], timeout: float = 600) -> dict:
    """-> {"heavy": the HEAVY modules imported, "startup_s": ...} of `verispec generate ARGS --json`."""
    script = ("import contextlib, io, json, sys\n"
              "from verispec.cli import main\n"
              "out = io.StringIO()\n"
              "with contextlib.redirect_stdout(out):\n"
              f"    main(['generate', *{generate_args!r}, '--json'])\n"
              f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
              "print(json.dumps({'heavy': heavy, 'startup_s': json.loads(out.getvalue())['startup_s']}))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])
