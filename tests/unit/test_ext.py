"""The kernels' build cache: a built kernel is found on disk, a missing one is built in its own process."""

from __future__ import annotations

import pytest

from verispec.runtime import ext
from verispec.runtime.dense import kernel as dense_kernel


def test_a_built_kernel_is_cached_and_an_empty_cache_is_not(tmp_path, monkeypatch):
    if dense_kernel() is None:
        pytest.skip("no C++ compiler here: the dense kernel is not built")
    assert ext.is_cached("dense")  # built (or loaded) above, under the real cache root
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    assert not any(ext.is_cached(name) for name in ext.KERNELS)


def test_build_all_starts_one_process_per_missing_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    started = []

    class Proc:  # stands in for the compiler's process: records what it was asked to build
        def __init__(self, argv):
            started.append(argv[-1])

        def wait(self):
            return 0

    monkeypatch.setattr(ext.subprocess, "Popen", Proc)
    monkeypatch.setattr(ext, "is_cached", lambda name: name == "layer")
    assert set(ext.build_all()) == {"dense", "quant"}
    assert len(started) == 2 and all("build(" in code for code in started)


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path, monkeypatch):
    """torch's lock file in the build folder (a builder killed mid-build leaves it) is cleared under verispec's own
    lock, which the OS releases with its process; the source is compiled from a copy in the folder."""
    if dense_kernel() is None:
        pytest.skip("no C++ compiler here")
    from pathlib import Path

    source = Path(ext.__file__).with_name("layer_kernel.cpp")
    folder, _ = ext._folder("layer", source, ext.CFLAGS)
    if not ext.is_cached("layer"):
        pytest.skip("the layer kernel is not built yet (this test must not build it)")
    (folder / "lock").write_text("")  # as a killed build leaves it
    ext._BUILT.pop("layer", None)
    assert ext.build("layer", "layer_kernel.cpp") is not None  # would wait forever on torch's lock
    assert not (folder / "lock").exists() and (folder / "layer_kernel.cpp").read_text() == source.read_text()
