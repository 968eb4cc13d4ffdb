"""The skip rule (tests/ci_skips.py): where CI is set, only a skip for what the machine lacks passes."""

from __future__ import annotations

from types import SimpleNamespace

import ci_skips
from ci_skips import machine_reason


def report(longrepr, outcome: str = "skipped", **extra) -> SimpleNamespace:
    return SimpleNamespace(skipped=outcome == "skipped", longrepr=longrepr, **extra)


def test_where_ci_is_set_only_a_machine_skip_passes(monkeypatch):
    monkeypatch.setattr(ci_skips, "STRICT_SKIPS", True)
    assert ci_skips.unaccepted_skip(report(("t.py", 3, "Skipped: a package is missing"))) == "a package is missing"
    assert ci_skips.unaccepted_skip(report("could not import 'ray'")) == "could not import 'ray'"  # a module's
    assert ci_skips.unaccepted_skip(report(("t.py", 3, "Skipped: " + machine_reason("needs a CUDA device")))) is None
    assert ci_skips.unaccepted_skip(report(("t.py", 3, machine_reason("no AVX512_BF16 on this CPU")))) is None
    assert ci_skips.unaccepted_skip(report(None, outcome="passed")) is None
    assert ci_skips.unaccepted_skip(report(("t.py", 3, "reason"), wasxfail="expected")) is None  # an xfail
    monkeypatch.setattr(ci_skips, "STRICT_SKIPS", False)  # a developer's machine: every skip stays a skip
    assert ci_skips.unaccepted_skip(report(("t.py", 3, "Skipped: a package is missing"))) is None
