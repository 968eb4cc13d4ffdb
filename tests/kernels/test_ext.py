"""The kernels' build cache: a built kernel is found on disk, a missing one is built in its own process."""

from __future__ import annotations

from pathlib import Path

import pytest

from verispec.runtime.kernels import ext

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


@pytest.mark.kernel("dense")
def test_a_built_kernel_is_cached_and_an_empty_cache_is_not(tmp_path, monkeypatch):
    assert ext.is_cached("dense")  # built (or loaded) above, under the real cache root
    for name, (source, flags) in ext.VARIANTS.items():  # a variant's folder is keyed by its own flags
        assert ext._folder(name, Path(ext.__file__).with_name(source), ext.CFLAGS + list(flags)) != \
            ext._folder(name, Path(ext.__file__).with_name(source), ext.CFLAGS)
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
    assert set(ext.build_all()) == {"dense", "quant", "pool"}
    assert len(started) == 3 and all("build(" in code for code in started)
    started.clear()
    assert set(ext.build_all(variants=True)) == {"dense", "quant", "pool", *ext.VARIANTS}  # make test's: the tests' builds too
    for name, (source, flags) in ext.VARIANTS.items():
        assert any(f"build({name!r}, {source!r}, {flags!r})" in code for code in started)


@pytest.mark.kernel("layer")  # built (or found on disk) first: the test times a load, not a compile
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path, monkeypatch):
    """torch's lock file in the build folder (a builder killed mid-build leaves it) is cleared under verispec's own
    lock, which the OS releases with its process; the source is compiled from a copy in the folder."""
    source = Path(ext.__file__).with_name("layer_kernel.cpp")
    folder, _ = ext._folder("layer", source, ext.CFLAGS)
    assert ext.is_cached("layer")
    (folder / "lock").write_text("")  # as a killed build leaves it
    ext._BUILT.pop("layer", None)
    assert ext.build("layer", "layer_kernel.cpp") is not None  # would wait forever on torch's lock
    assert not (folder / "lock").exists() and (folder / "layer_kernel.cpp").read_text() == source.read_text()


def _split_kernel(folder):
    """A kernel in three files: main.cpp includes part.h, which includes part.cpp; <vector> and a quoted name not
    beside it are the compiler's to find."""
    (folder / "main.cpp").write_text('#include <vector>\n#include "part.h"\n#include "torch/extension.h"\nint f();\n')
    (folder / "part.h").write_text('#pragma once\n  # include "part.cpp"\nint g();\n')
    (folder / "part.cpp").write_text('#include "part.h"\nint g() { return 1; }\n')
    return folder / "main.cpp"


def test_the_key_changes_with_every_included_file(tmp_path):
    """A kernel split into several files rebuilds when any of them changes: the key hashes each local include,
    recursively (no compiler runs here)."""
    source = _split_kernel(tmp_path)
    assert ext.local_includes(source) == [Path("part.h"), Path("part.cpp")]
    keys = {ext.cache_key(source, ext.CFLAGS)}
    assert ext.cache_key(source, ext.CFLAGS) in keys  # the same files give the same key
    for name in ["part.cpp", "part.h", "main.cpp"]:  # part.cpp is only reached through part.h
        (tmp_path / name).write_text((tmp_path / name).read_text() + "// changed\n")
        keys.add(ext.cache_key(source, ext.CFLAGS))
    assert len(keys) == 4


def test_the_key_of_a_kernel_without_local_includes(tmp_path):
    """A single-file kernel's key: its text, torch's version and installation, the CPU flags and the cflags."""
    import hashlib

    import torch

    source = tmp_path / "one.cpp"
    source.write_text('#include <torch/extension.h>\n#include "not_here.h"\nint f();\n')
    text = source.read_text() + torch.__version__ + ext.installation() + ext.cpu_flags_line() + " ".join(ext.CFLAGS)
    assert ext.local_includes(source) == []
    assert ext.cache_key(source, ext.CFLAGS) == hashlib.sha256(text.encode()).hexdigest()[:16]


def test_the_build_folder_gets_a_copy_of_every_included_file(tmp_path):
    (tmp_path / "src").mkdir()
    source = _split_kernel(tmp_path / "src")
    folder = tmp_path / "build"
    folder.mkdir()
    copy = ext.copy_sources(source, folder)
    assert copy == folder / "main.cpp"
    for name in ["main.cpp", "part.h", "part.cpp"]:
        assert (folder / name).read_text() == (source.parent / name).read_text()


def test_an_include_outside_the_kernels_folder_is_refused(tmp_path):
    (tmp_path / "shared.h").write_text("int h();\n")
    (tmp_path / "kernel").mkdir()
    source = tmp_path / "kernel" / "k.cpp"
    source.write_text('#include "../shared.h"\n')
    with pytest.raises(ValueError, match="outside"):
        ext.local_includes(source)


def test_a_broken_kernel_falls_back_saying_so_or_raises_where_required(tmp_path, monkeypatch, capsys):
    """A source the compiler refuses: with VERISPEC_REQUIRE_KERNELS=1, KernelBuildError with the compiler's words, at
    every call (the failure is remembered, not rebuilt); without it, None (the torch fallback) and one message."""
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ext, "_BUILT", {})
    source = tmp_path / "broken_kernel.cpp"
    source.write_text('#error "a planted compile error"\n')
    monkeypatch.setenv(ext.REQUIRE_ENV, "1")
    assert ext.required()
    with pytest.raises(ext.KernelBuildError, match="(?s)kernel broken_required .*VERISPEC_REQUIRE_KERNELS.*planted "
                                                   "compile error"):
        ext.build("broken_required", source)
    with pytest.raises(ext.KernelBuildError, match="planted compile error"):
        ext.build("broken_required", source)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv(ext.REQUIRE_ENV, "0")
    assert not ext.required()
    assert ext.build("broken", source) is None
    assert "broken_kernel.cpp not built" in capsys.readouterr().out
    assert ext.build("broken", source) is None and capsys.readouterr().out == ""  # told once
    monkeypatch.delenv(ext.REQUIRE_ENV)
    assert not ext.required() and ext.build("broken", source) is None


def test_build_all_raises_on_a_failed_build_where_required(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))

    class Proc:  # a builder process; the quant kernel's fails
        def __init__(self, argv):
            self.code = 1 if "'quant'" in argv[-1] else 0

        def wait(self):
            return self.code

    monkeypatch.setattr(ext.subprocess, "Popen", Proc)
    monkeypatch.setattr(ext, "is_cached", lambda name: False)
    monkeypatch.delenv(ext.REQUIRE_ENV, raising=False)
    assert set(ext.build_all()) == set(ext.KERNELS)  # each process printed its own message; the fallbacks serve
    monkeypatch.setenv(ext.REQUIRE_ENV, "1")
    with pytest.raises(ext.KernelBuildError, match="kernels not built: quant "):
        ext.build_all()


def test_two_environments_get_two_builds(monkeypatch, tmp_path):
    """Another virtualenv (another torch folder or interpreter prefix) keys another build folder: the two never
    rebuild each other's kernel."""
    source = tmp_path / "one.cpp"
    source.write_text("int f();\n")
    key = ext.cache_key(source, ext.CFLAGS)
    monkeypatch.setattr(ext.sys, "prefix", str(tmp_path / "other-venv"))
    assert ext.cache_key(source, ext.CFLAGS) != key

