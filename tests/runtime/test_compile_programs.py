"""`compile.run_program`'s bookkeeping, with stand-in programs (no compiler): a program whose guards refuse the
inputs is not run; inputs of two kinds compile one program each, once, whatever their order; any other error
reaches the caller."""

import pytest

from verispec.runtime.model import compile as compile_mod

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


@pytest.fixture
def fake_compiles(monkeypatch, tmp_path):
    """Programs that accept only the first argument they were compiled for; -> the kinds compiled, in order."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))  # no saved program is found
    monkeypatch.setattr(compile_mod, "_PROGRAMS", {})
    compiled = []

    def fake_compile(fn, args, dynamic, path):
        kind = args[0]
        compiled.append(kind)

        def program(*given):
            if given[0] != kind:
                raise RuntimeError("GuardManager check failed, reason: GuardDebugInfo(...)")
            if kind == "broken":
                raise RuntimeError("something else went wrong")
            return fn(*given)

        return program

    monkeypatch.setattr(compile_mod, "_compile", fake_compile)
    return compiled


def test_inputs_of_two_kinds_compile_one_program_each(fake_compiles):
    def twice(x):
        return x * 2

    for kind in ["a", "b", "a", "b", "a"]:
        assert compile_mod.run_program(twice, ("key",), (kind,), {}) == kind * 2
    assert fake_compiles == ["a", "b"]
    compile_mod.run_program(twice, ("another key",), ("a",), {})
    assert fake_compiles == ["a", "b", "a"]  # per key


def test_other_errors_are_not_taken_for_a_refusal(fake_compiles):
    with pytest.raises(RuntimeError, match="something else"):
        compile_mod.run_program(lambda x: x, ("key",), ("broken",), {})
    assert fake_compiles == ["broken"]
