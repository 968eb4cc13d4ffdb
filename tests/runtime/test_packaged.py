"""Model files shipped in parts on PyPI (runtime/model/packaged.py): joined once, checked by size and sha256,
atomically; a missing package, a short part or a damaged byte is a clear error naming the package, never half a
file; a joined file is found again by its stamp, and joined anew when it changed."""

from __future__ import annotations

import hashlib
import os

import pytest

from verispec.runtime.model import packaged
from verispec.runtime.model.files import ModelLoadError
from verispec.runtime.model.packaged import PACKAGED, PackagedFile

# Pure and fast: in `make test-unit` (-m unit) though it lives with its subject.
pytestmark = pytest.mark.unit


def fake_dist(site, name: str, parts: list[bytes], version: str = "1.0") -> None:
    """An installed distribution `name` holding `parts` as data/partNN.bin (what the chunk packages hold)."""
    module = name.replace("-", "_")
    info = site / f"{module}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    rows = []
    (site / module / "data").mkdir(parents=True)
    for i, part in enumerate(parts, 1):
        (site / module / "data" / f"part{i:02d}.bin").write_bytes(part)
        rows.append(f"{module}/data/part{i:02d}.bin,,")
    (info / "RECORD").write_text("\n".join(rows + [f"{module}/__init__.py,,"]) + "\n")


@pytest.fixture
def file(tmp_path, monkeypatch):
    """A two-package file of 3 parts, the cache under tmp_path."""
    site = tmp_path / "site"
    chunks = [os.urandom(1000), os.urandom(10), os.urandom(4000)]
    fake_dist(site, "model-part1", chunks[:2])
    fake_dist(site, "model-part2", chunks[2:])
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    packaged._joined.cache_clear()
    whole = b"".join(chunks)
    return PackagedFile("tiny", "tiny.gguf", ("model-part1", "model-part2"), "1.0", len(whole),
                        hashlib.sha256(whole).hexdigest(), "pip install tiny"), whole, site


def test_parts_are_joined_once_in_order_and_found_again_by_their_stamp(file, monkeypatch):
    spec, whole, _ = file
    path = spec.path()
    assert path.read_bytes() == whole and path.parent.name == "models"
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    packaged._joined.cache_clear()
    monkeypatch.setattr(PackagedFile, "parts", lambda self: pytest.fail("joined again"))
    assert spec.path() == path  # the stamp matches: no parts read, no hash


def test_a_changed_file_is_joined_anew(file):
    spec, whole, _ = file
    path = spec.path()
    path.write_bytes(b"x" * len(whole))  # same size, new mtime
    packaged._joined.cache_clear()
    assert spec.path().read_bytes() == whole


def test_a_missing_package_names_it_and_the_install(file):
    spec, _, _ = file
    missing = PackagedFile(**{**spec.__dict__, "packages": (*spec.packages, "model-part3")})
    with pytest.raises(ModelLoadError, match=r"model-part3==1\.0.*pip install tiny"):
        missing.path()


def test_a_damaged_part_is_refused_and_leaves_no_file(file):
    spec, whole, site = file
    part = site / "model_part2" / "data" / "part01.bin"
    damaged = bytearray(part.read_bytes())
    damaged[7] ^= 1
    part.write_bytes(bytes(damaged))
    with pytest.raises(ModelLoadError, match="sha256.*damaged.*pip install tiny"):
        spec.path()
    folder = packaged._models_dir()
    assert not any(folder.iterdir()) if folder.exists() else True


def test_a_short_part_is_refused_before_anything_is_written(file):
    spec, _, site = file
    (site / "model_part1" / "data" / "part02.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="add up to 5,000 bytes, not 5,010"):
        spec.path()
    assert not packaged._models_dir().exists()


def test_the_coder_pairs_records():
    target, draft = PACKAGED["qwen2.5-coder-1.5b-instruct"], PACKAGED["qwen2.5-coder-0.5b-instruct"]
    assert len(target.packages) == 22 and target.size == 1_117_320_768
    assert len(draft.packages) == 6 and draft.size == 491_400_064
    assert all("verispec[coder]" in f.install for f in (target, draft))
