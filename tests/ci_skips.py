"""The skip rule of the suite (a pytest plugin; tests/conftest.py takes its hooks, `pytest -p ci_skips` alone loads
it without the suite's imports).

A skipped test proves nothing. Where CI is set (.ci/run sets CI=true), a skip is accepted only where the machine
lacks what the test needs, hardware or an OS facility (a CUDA device, a CPU's instructions, /proc, transparent huge
pages): those skips give `machine_reason(...)`. Every other skip (a missing package, a kernel that did not build, a
forced code path) fails its test there, or its module's collection, with the reason.
"""

from __future__ import annotations

import os

import pytest

MACHINE = "this machine: "
STRICT_SKIPS = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def machine_reason(reason: str) -> str:
    """The reason of a skip for what this machine lacks (hardware, the OS): the only skips CI accepts."""
    return MACHINE + reason


def unaccepted_skip(report) -> str | None:
    """The reason of a skip that CI does not accept (None: not a skip, or an accepted one)."""
    if not (STRICT_SKIPS and report.skipped) or hasattr(report, "wasxfail"):
        return None
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    return None if reason.startswith(MACHINE) else reason


def _fail_skip(report, reason: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"skipped where CI is set ({reason}): only a skip for what the machine lacks "
                       f"(machine_reason) passes CI")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if (reason := unaccepted_skip(report)) is not None:
        _fail_skip(report, reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if (reason := unaccepted_skip(report)) is not None:  # a module skipped whole (pytest.importorskip)
        _fail_skip(report, reason)
