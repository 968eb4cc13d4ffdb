"""`--batch-invariant` and `serve --deterministic` reach RunnerOptions; unset (None) by default, which
`make_runner` resolves to on where verispec's C++ kernels run (free there; docs/speculation.md "Bit for bit")."""

import pytest

from verispec.cli import build_parser
from verispec.cli.common import runner_options

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


@pytest.mark.parametrize("argv, want", [
    (["generate", "--prompt", "x"], None),
    (["generate", "--prompt", "x", "--no-batch-invariant"], False),
    (["generate", "--prompt", "x", "--batch-invariant"], True),
    (["serve"], None),
    (["serve", "--deterministic"], True),
    (["serve", "--batch-invariant"], True),
])
def test_runner_options_batch_invariant(argv, want):
    assert runner_options(build_parser().parse_args(argv)).batch_invariant is want



def test_unset_means_on_where_the_kernels_run(trained_pair):
    from verispec.config import RunnerOptions
    from verispec.runtime.model.dtype import kernels_built
    from verispec.runtime.runners.select import make_runner

    target, _ = trained_pair
    assert make_runner(target, 64, options=RunnerOptions(backend="native")).batch_invariant is kernels_built()
    assert make_runner(target, 64, options=RunnerOptions(backend="native", batch_invariant=False)).batch_invariant is False
