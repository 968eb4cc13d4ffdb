"""runtime/model/compile.py: the compiled step's disk cache is keyed by torch version and CPU flags, under VERISPEC_CACHE."""

import pytest
import torch

from verispec.runtime.model import compile as compile_mod

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


def test_cache_folder_is_keyed_and_made(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # recorded, so what use_disk_cache sets is undone afterwards
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(compile_mod, "cpu_flags", lambda: frozenset({"avx2"}))
    avx2 = compile_mod.use_disk_cache()
    assert avx2.is_dir() and avx2.parent == tmp_path / "compile" and torch.__version__ in avx2.name
    monkeypatch.setattr(compile_mod, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert compile_mod.cache_dir() != avx2  # other CPU features, other generated code


def test_a_users_inductor_cache_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_mod.use_disk_cache() == tmp_path / "mine"


def test_inductors_own_default_is_not_the_users_choice(monkeypatch, tmp_path):
    """Importing torch._dynamo writes Inductor's default folder into TORCHINDUCTOR_CACHE_DIR: that is not a choice."""
    import torch._dynamo  # noqa: F401  (what sets the variable)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    assert compile_mod.use_disk_cache() == compile_mod.cache_dir()
    assert compile_mod.cache_dir().parent == tmp_path / "compile"
