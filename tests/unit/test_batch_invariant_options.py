"""`--batch-invariant` and `serve --deterministic` reach RunnerOptions; off by default (it costs prefill speed at
large batches, see docs/speculation.md "Bit for bit")."""

import pytest

from verispec.cli import build_parser
from verispec.cli.common import runner_options


@pytest.mark.parametrize("argv, want", [
    (["generate", "--prompt", "x"], False),
    (["generate", "--prompt", "x", "--no-batch-invariant"], False),
    (["generate", "--prompt", "x", "--batch-invariant"], True),
    (["serve"], False),
    (["serve", "--deterministic"], True),
    (["serve", "--batch-invariant"], True),
])
def test_runner_options_batch_invariant(argv, want):
    assert runner_options(build_parser().parse_args(argv)).batch_invariant is want

