"""verispec's C++ kernels, built on first use with torch's cpp_extension and cached on disk.

Each kernel file next to this module (`quant_kernel.cpp`, ...) is its own extension, built with -march=native
for the CPU at hand under ~/.cache/verispec/ext/<name>-<hash of sources, torch version, CPU flags>, so a second
process loads it in milliseconds. A kernel may be split into several files: the local files it includes
(`#include "x.h"` or `"x.cpp"` beside the including file, recursively) are hashed and copied with it, so a change
to any of them rebuilds it. Where no compiler, headers or OpenMP are found, `build` returns None (once, with a
message) and the caller keeps its torch fallback; under VERISPEC_REQUIRE_KERNELS=1 (CI and `make test` set it) a
failed build raises `KernelBuildError` instead, so a broken kernel fails the tests rather than skipping them.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import overrides

try:
    import fcntl
except ImportError:  # not POSIX: torch's own lock file only
    fcntl = None

_BUILT: dict[str, object] = {}  # name -> module, or the exception its build raised
_POOLED: set[str] = set()  # kernels handed the work pool (pool.py)
REQUIRE_ENV = "VERISPEC_REQUIRE_KERNELS"
POOL_ENV = "VERISPEC_POOL"

CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
# Every kernel: name -> its source beside this module (what `python -m verispec.runtime.kernels.ext` builds ahead of use).
KERNELS = {"dense": "dense_kernel.cpp", "layer": "layer_kernel.cpp", "quant": "quant_kernel.cpp", "pool": "pool.cpp"}
# Builds only the tests load: name -> (source, extra cflags). The layer and quant kernels as for an x86 CPU without
# AVX-512 (tests/kernels/test_fused.py and test_quant_q8.py compare their bits with the full build's: the quant one
# runs maddubs where this CPU's own build runs vpdpbusd on 256 bits); `build_all(variants=True)` (make test) builds
# them beside the kernels.
VARIANTS = {"layer_avx2": ("layer_kernel.cpp", ("-mno-avx512f",)), "quant_avx2": ("quant_kernel.cpp", ("-mno-avx512f",))} \
    if platform.machine() in ("x86_64", "AMD64") else {}


def cache_root() -> Path:
    return Path(overrides.read("VERISPEC_CACHE") or Path.home() / ".cache" / "verispec").expanduser()


def cpu_flags_line() -> str:
    """/proc/cpuinfo's flags line (what -march=native code depends on), or torch's CPU capability."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


class KernelBuildError(RuntimeError):
    """A kernel failed to build where VERISPEC_REQUIRE_KERNELS=1 asks for every kernel."""


def required() -> bool:
    """Whether a kernel that fails to build is an error (VERISPEC_REQUIRE_KERNELS=1) rather than a fallback."""
    return (overrides.read(REQUIRE_ENV) or "").strip() not in ("", "0")


def build(name: str, source: str | Path, extra_cflags: tuple[str, ...] = ()):
    """The extension made of `source` (a file beside this module, or a path), built once per process and cached on
    disk; None where it cannot be built. Raises KernelBuildError instead where `required()`."""
    if name not in _BUILT:
        try:
            _BUILT[name] = _load(name, Path(__file__).parent / source, list(extra_cflags))
        except Exception as exc:  # noqa: BLE001 - no compiler, headers or OpenMP: the torch fallback serves
            _BUILT[name] = exc
            if not required():
                print(f"[verispec] {Path(source).name} not built ({str(exc)[:200]}); its torch fallback runs instead")
    built = _BUILT[name]
    if isinstance(built, Exception):
        if required():
            raise KernelBuildError(f"the C++ kernel {name} ({Path(source).name}) did not build and {REQUIRE_ENV} is "
                                   f"set: {built}") from built
        return None
    if name not in _POOLED and hasattr(built, "use_pool"):
        _POOLED.add(name)
        attach_pool(built)
    return built


def pool_enabled() -> bool:
    """Whether the kernels run their parallel regions on the work pool (pool.py; VERISPEC_POOL=off keeps OpenMP)."""
    return (overrides.read(POOL_ENV) or "").strip().lower() not in ("off", "0", "false")


def pool_module():
    """The work pool's extension (pool.cpp), built on first use; None where it does not build or is switched off."""
    return build("pool", KERNELS["pool"]) if pool_enabled() else None


def attach_pool(module) -> None:
    """Hand kernel extension `module` the work pool (its `use_pool`); a no-op where there is no pool."""
    pool = pool_module()
    if pool is not None:
        module.use_pool(pool.api_address())


_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def local_includes(source: Path) -> list[Path]:
    """The local files `source` includes, recursively, each once in first-include order, as paths relative to
    `source`'s folder. An `#include "x"` names a local file when x exists beside the including file (otherwise the
    compiler finds it on its include path); one outside `source`'s folder is refused, since the build compiles a
    copy of that folder's files."""
    root = Path(os.path.normpath(source.parent))
    found: list[Path] = []
    pending = [Path(os.path.normpath(source))]
    while pending:
        including = pending.pop(0)
        for name in _LOCAL_INCLUDE.findall(including.read_text()):
            path = Path(os.path.normpath(including.parent / name))
            if not path.is_file():
                continue
            if not path.is_relative_to(root):
                raise ValueError(f"{including.name} includes {name}, outside {root}: keep a kernel's files in one "
                                 "folder")
            relative = path.relative_to(root)
            if relative not in found and relative != Path(source.name):
                found.append(relative)
                pending.append(path)
    return found


def cache_key(source: Path, flags: list[str]) -> str:
    """The build's key: a hash of the source and every local file it includes (name and text), torch's version and
    installation (its folder and the interpreter's prefix: torch's build file names the include paths of the
    environment, so two virtualenvs sharing one folder rebuilt each other's kernel on every switch, a minute each),
    the CPU flags and the cflags."""
    files = "".join(f"\0{relative}\0{(source.parent / relative).read_text()}" for relative in local_includes(source))
    text = (source.read_text() + files + torch.__version__ + installation() + cpu_flags_line() + " ".join(flags))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def installation() -> str:
    """Where this environment's torch and interpreter live (part of a build's key: `cache_key`)."""
    return f"\0{Path(torch.__file__).resolve().parent}\0{Path(sys.prefix).resolve()}"


def _folder(name: str, source: Path, flags: list[str]) -> tuple[Path, str]:
    """-> (the build folder, the key of `cache_key`)."""
    key = cache_key(source, flags)
    return cache_root() / "ext" / f"{name}-{key}", key


def copy_sources(source: Path, folder: Path) -> Path:
    """Copy `source` and its local includes (same relative paths) into `folder` -> the copy of `source`. A file
    whose copy already holds the same text is left alone, so its timestamp does not ask for a rebuild."""
    for relative in [Path(source.name), *local_includes(source)]:
        text, copy = (source.parent / relative).read_text(), folder / relative
        if not copy.exists() or copy.read_text() != text:
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(text)
    return folder / source.name


def _load(name: str, source: Path, extra: list[str]):
    from torch.utils.cpp_extension import load

    flags = CFLAGS + extra
    folder, key = _folder(name, source, flags)
    folder.mkdir(parents=True, exist_ok=True)
    # Compiled from a copy inside its folder: the build file names the source's path, so two checkouts with the same
    # source would otherwise rebuild each other's kernel.
    copy = copy_sources(source, folder)
    with open(folder / "verispec.lock", "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the OS releases it if the builder dies
        # torch's own lock file, left behind by a process killed mid-build, would make every later one wait forever;
        # under our lock nobody else is building.
        (folder / "lock").unlink(missing_ok=True)
        return load(name=f"verispec_{name}_{key}", sources=[str(copy)], build_directory=str(folder),
                    extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)


def is_cached(name: str) -> bool:
    """Whether kernel `name` (of KERNELS or VARIANTS) is already built on disk for this source, torch and CPU."""
    source, extra = VARIANTS.get(name, (KERNELS.get(name), ()))
    folder, _ = _folder(name, Path(__file__).with_name(source), CFLAGS + list(extra))
    return any(folder.glob("*.so"))


def build_all(variants: bool = False) -> dict[str, float]:
    """Build every kernel not yet on disk (and the tests' VARIANTS too where asked), each in its own process, all at
    once (one compiler each: on 2 cores the three together take about as long as the longest) -> seconds per kernel
    built. Where `required()`, a kernel that did not build raises KernelBuildError (its process printed the
    compiler's error)."""
    start, procs = time.perf_counter(), {}
    builds = {name: (source, ()) for name, source in KERNELS.items()} | (VARIANTS if variants else {})
    for name, (source, extra) in builds.items():
        if not is_cached(name):
            code = f"from verispec.runtime.kernels.ext import build; build({name!r}, {source!r}, {extra!r})"
            procs[name] = subprocess.Popen([sys.executable, "-c", code])
    seconds, failed = {}, []
    for name, proc in procs.items():
        if proc.wait() != 0:
            failed.append(name)
        seconds[name] = round(time.perf_counter() - start, 1)
    if failed and required():
        raise KernelBuildError(f"kernels not built: {', '.join(failed)} ({REQUIRE_ENV} is set; the errors are above)")
    return seconds
