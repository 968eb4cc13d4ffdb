"""The native model's whole step (`llama.model_forward`: embedding, every layer, the LM head) compiled as one
program per shape class, saved on disk so that a later process loads it instead of tracing and compiling.

Shape classes: a model compiles one program per (one row / many rows) x (one fed token / many) x (logits wanted at
one / many / all positions); the sizes that are "many" and the attended length are dynamic in it (marked before
the compile), so a decode step, a verify pass and a prefill chunk each compile once, whatever their sizes.

Programs: `torch.compile(model_forward, fullgraph=True).aot_compile(...)`, saved with `save_compiled_function` under
`~/.cache/verispec/compile/<torch version, CPU flags>/programs/<key>.bin`, the key naming the model's structure
(its spec, the weights' shapes and dtypes, the packing), the cache length, the shape class and a hash of
verispec's runtime sources (the code traced into the program). A later process loads the file
(`torch.compiler.load_compiled_function`: no Dynamo trace, no Inductor), about 0.1-2 s a program instead of the
5-50 s a trace and compile take. A program's guards still check every call's inputs; one that no longer fits
(another torch, a changed model) is compiled again and replaced. Inductor's own caches (FX graph, AOTAutograd)
sit beside it, so a program compiled again reuses what it can.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from ..kernels.ext import cache_root
from .dtype import cpu_flags

logger = logging.getLogger("verispec")

_PROGRAMS: dict[tuple, list[Callable]] = {}  # key -> this process's programs for it (loaded, compiled)
COUNTS: collections.Counter = collections.Counter()  # "loaded" / "compiled": programs this process
_SOURCES: list[str] = []  # the runtime sources' hash, computed once


def cache_dir() -> Path:
    """~/.cache/verispec/compile/<torch version>-<hash of the CPU flags> ($VERISPEC_CACHE overrides the root)."""
    root = cache_root()
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return root / "compile" / f"torch-{torch.__version__}-cpu-{flags}"


def use_disk_cache() -> Path:
    """Point Inductor's caches at verispec's folder (unless the user set TORCHINDUCTOR_CACHE_DIR) -> the folder.

    Importing torch._dynamo writes Inductor's default (/tmp/torchinductor_<user>) into TORCHINDUCTOR_CACHE_DIR, so
    a value equal to that default is taken as unset; Inductor reads the variable at each cache lookup."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not given or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())
    folder = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return folder


def sources_hash() -> str:
    """A hash of verispec's runtime sources (what a program traces: the model, its kernels' wrappers): a saved
    program from other sources is never loaded."""
    if not _SOURCES:
        digest = hashlib.sha256()
        runtime = Path(__file__).parents[1]
        for path in sorted(runtime.rglob("*.py")):
            digest.update(path.relative_to(runtime).as_posix().encode() + b"\0" + path.read_bytes())
        _SOURCES.append(digest.hexdigest()[:16])
    return _SOURCES[0]


def program_path(key: tuple) -> Path:
    """Where the program for `key` (what fixes the traced code: see `run_program`) is saved."""
    name = hashlib.sha256(repr((sources_hash(), key)).encode()).hexdigest()[:32]
    return cache_dir() / "programs" / f"{name}.bin"


def _marked(value, dims: tuple[int, ...], views: dict[int, torch.Tensor]):
    """A stand-in for value (or each tensor of a tuple) with `dims` marked dynamic; the caller's tensors stay
    unmarked (a saved program's guards refuse inputs that carry markings the compile did not see). One stand-in per
    tensor (`views`, by id), so arguments that are one tensor stay one (the guards check that too)."""
    if isinstance(value, tuple):
        return tuple(_marked(v, dims, views) for v in value)
    if id(value) not in views:  # a view where value is one (the guards check which), else a fresh tensor of the
        # same shape, dtype and strides, never read (the trace runs on fake tensors)
        views[id(value)] = value.view(value.shape) if value._is_view() else torch.empty_strided(
            value.shape, value.stride(), dtype=value.dtype, device=value.device)
    view = views[id(value)]
    for dim in dims:  # dynamic unless the traced code needs the size (then a guard holds it)
        torch._dynamo.maybe_mark_dynamic(view, dim)
    return view


def _load(path: Path) -> Callable | None:
    try:
        with open(path, "rb") as file:
            return torch.compiler.load_compiled_function(file)
    except FileNotFoundError:
        return None
    except Exception as exc:  # an unreadable or foreign file: compiled again below
        logger.warning("compiled step %s not loaded (%s: %s): compiling it again", path.name, type(exc).__name__, exc)
        return None


def _compile(fn: Callable, args: tuple, dynamic: dict[int, tuple[int, ...]], path: Path) -> Callable:
    """fn traced and compiled on args (the `dynamic` argument dims marked), saved to path -> the program."""
    use_disk_cache()
    compiled = torch.compile(fn, fullgraph=True)
    COUNTS["compiled"] += 1
    if not hasattr(compiled, "aot_compile"):  # a torch before 2.13 (the pin): compiled in process, Inductor's cache
        logger.info("this torch (%s) has no aot_compile: the step is compiled in each process", torch.__version__)
        # every class shares model_forward's code object: more specialisations than Dynamo's default 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        return compiled
    views: dict[int, torch.Tensor] = {}
    marked = tuple(_marked(a, dynamic[i], views) if i in dynamic else a for i, a in enumerate(args))
    program = compiled.aot_compile((marked, {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(f".{os.getpid()}.part")
    try:
        program.save_compiled_function(str(part))
        os.replace(part, path)  # whole or absent, whoever else writes it
    except Exception as exc:  # kept for this process only
        part.unlink(missing_ok=True)
        logger.warning("compiled step not saved (%s: %s): later processes compile it again", type(exc).__name__, exc)
    return program


def run_program(fn: Callable, key: tuple, args: tuple, dynamic: dict[int, tuple[int, ...]]):
    """fn(*args) through a compiled program for `key` (hashable, naming everything that fixes the traced code beside
    the sources: the model's structure, the shape class, the constant arguments): one of this process's, else the
    one saved on disk, else compiled now (its argument dims in `dynamic` marked dynamic) and saved. Where every
    program's guards refuse args, one more is compiled (kept beside the others, so inputs that alternate between
    two kinds compile each once) and saved in place of the file."""
    programs = _PROGRAMS.setdefault(key, [])  # (the key's hash is cached with its strings: no file name to make)
    if not programs:
        loaded = _load(program_path(key))
        if loaded is not None:
            COUNTS["loaded"] += 1
            programs.append(loaded)
    for program in programs:
        try:
            return program(*args)
        except RuntimeError as exc:
            if "GuardManager check failed" not in str(exc):
                raise
            logger.info("a compiled step does not fit these inputs (%s)", exc)
    program = _compile(fn, args, dynamic, program_path(key))
    programs.append(program)
    return program(*args)


def cache_counts() -> dict[str, int]:
    """This process's compiled programs: loaded from disk, and compiled (then saved)."""
    return {"programs_loaded": COUNTS["loaded"], "programs_compiled": COUNTS["compiled"]}
