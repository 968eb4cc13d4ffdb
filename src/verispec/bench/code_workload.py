"""`verispec bench --workload code`: what a coding assistant is asked, over real source, built at run time.

The source: module-level functions of pure-Python standard-library modules (`SOURCE_MODULES`), read from the
running interpreter's own files with `ast` (never imported, nothing downloaded). A function qualifies when it is 6..40
lines and at most 1,600 characters, undecorated, with at least one parameter. Selection is deterministic for one
Python version and seed: the candidates sorted by (module, name), shuffled by `random.Random(seed)`, then taken in
that order, one category after another, each function once and at most `PER_MODULE` per module.

Four categories (`CATEGORIES`), each a single user turn as chat prompts are:
- `write`: a public function with a docstring, given only its signature and docstring: write it;
- `explain`: the whole function: explain what it does and how;
- `test`: a public function: write pytest tests for it (imported from its module);
- `edit`: the whole function and one edit (rename a parameter and add type hints, validate an argument, rename a
  local variable, ...): return the whole function, so most of the answer copies the prompt.

The prompts are written as the JSON lines `prompts.load_prompts` reads (`question_id`, `category`, `turns`, plus
`source`: `module.function`, and `task`: the edit's kind), so a run keeps the exact prompts beside its report.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import json
import platform
import random
import textwrap
from dataclasses import dataclass
from pathlib import Path

CATEGORIES = ("write", "explain", "test", "edit")
PER_CATEGORY = 10  # prompts per category (`--limit N` keeps the first N of each)
PER_MODULE = 3  # at most this many functions of one module, so the set spans many modules
MIN_LINES, MAX_LINES, MAX_CHARS = 6, 40, 1600
MAX_DOC_CHARS = 700
# Pure-Python modules of the standard library, present in every CPython 3.9+ (a module whose source is not a .py
# file on this interpreter, e.g. frozen, is skipped and named in `describe`).
SOURCE_MODULES = (
    "ast", "base64", "bisect", "calendar", "colorsys", "copy", "dataclasses", "datetime", "difflib", "email.utils",
    "filecmp", "fnmatch", "functools", "gettext", "glob", "heapq", "html", "inspect", "ipaddress", "linecache",
    "locale", "mimetypes", "operator", "plistlib", "pprint", "quopri", "shlex", "shutil", "statistics", "tarfile",
    "tempfile", "textwrap", "tokenize", "urllib.parse", "uuid", "zipfile",
)


@dataclass(frozen=True)
class SourceFunction:
    """One module-level function as it is written in its module's file."""

    module: str
    name: str
    source: str  # the `def` through its last line, dedented
    signature: str  # "(a, b=1) -> int"
    docstring: str  # cleaned (inspect.cleandoc); "" when it has none
    params: tuple[str, ...]  # positional and keyword parameter names, `self`/`cls` left out
    locals: tuple[str, ...]  # names the body assigns that are not parameters, in order of first assignment

    @property
    def public(self) -> bool:
        return not self.name.startswith("_")


def module_source(name: str) -> str | None:
    """The module's source text, read from its file without importing it (None: no .py file here)."""
    spec = importlib.util.find_spec(name)
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return None
    return Path(origin).read_text(encoding="utf-8")


def _assigned(node: ast.FunctionDef, params: set[str]) -> tuple[str, ...]:
    names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    return tuple(n for n in dict.fromkeys(names) if n not in params and not n.startswith("_"))


def functions_of(module: str, text: str) -> list[SourceFunction]:
    """The module's qualifying functions (module docstring), in file order."""
    lines = text.splitlines()
    out = []
    for node in ast.parse(text).body:
        if not isinstance(node, ast.FunctionDef) or node.decorator_list:
            continue
        count = node.end_lineno - node.lineno + 1
        source = "\n".join(lines[node.lineno - 1:node.end_lineno])
        if not MIN_LINES <= count <= MAX_LINES or len(source) > MAX_CHARS or "\t" in source:
            continue
        args = node.args
        params = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg not in ("self", "cls")]
        if not params:
            continue
        returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
        doc = inspect.cleandoc(ast.get_docstring(node, clean=False) or "")
        out.append(SourceFunction(module, node.name, textwrap.dedent(source), f"({ast.unparse(args)}){returns}", doc,
                                  tuple(params), _assigned(node, set(params))))
    return out


def candidates(modules: tuple[str, ...] = SOURCE_MODULES) -> tuple[list[SourceFunction], list[str]]:
    """-> (every qualifying function of the modules, sorted by (module, name); the modules with no source here)."""
    found, missing = [], []
    for module in modules:
        text = module_source(module)
        if text is None:
            missing.append(module)
            continue
        found += functions_of(module, text)
    return sorted(found, key=lambda f: (f.module, f.name)), missing


def _doc_summary(doc: str) -> str:
    """The docstring up to MAX_DOC_CHARS, cut at a paragraph end where one falls inside."""
    if len(doc) <= MAX_DOC_CHARS:
        return doc
    cut = doc.rfind("\n\n", 0, MAX_DOC_CHARS)
    return doc[:cut] if cut > 0 else doc[:MAX_DOC_CHARS].rsplit(" ", 1)[0] + " ..."


def _fits(fn: SourceFunction, category: str) -> bool:
    if category == "write":
        return fn.public and len(fn.docstring) >= 40
    if category == "test":
        return fn.public
    return True


def _block(fn: SourceFunction) -> str:
    return f"```python\n{fn.source}\n```"


def edit_tasks(fn: SourceFunction) -> list[tuple[str, str]]:
    """(kind, instruction) of every edit that applies to the function."""
    first = fn.params[0]
    tasks = [
        ("rename-parameter", f"Rename the parameter `{first}` to `{first}_value` everywhere in the function and add "
                             "type hints to its signature."),
        ("type-hints", "Add type hints to every parameter and to the return value, and add a one-line docstring at "
                       "the top if it has none."),
        ("validate", f"At the top of the function, raise a `TypeError` with a clear message when `{fn.params[-1]}` "
                     "is `None`. Keep everything else as it is."),
        ("comments", "Add a short comment above each loop, branch and return saying why it is there. Do not change "
                     "the code itself."),
    ]
    if fn.locals:
        local = fn.locals[0]
        tasks.append(("rename-local", f"Rename the function to `{fn.name.lstrip('_')}_checked` and its local "
                                      f"variable `{local}` to `{local}_tmp`."))
    return tasks


def prompt_text(fn: SourceFunction, category: str, rng: random.Random) -> tuple[str, str]:
    """-> (the user turn, the task's kind) for one function and category."""
    where = f"Python's `{fn.module}` module"
    if category == "write":
        return (f"Write a Python function `{fn.name}{fn.signature}` that does the following:\n\n"
                f"{_doc_summary(fn.docstring)}\n\nUse only the standard library, and reply with the function in one "
                "code block followed by a two-sentence explanation.", "write")
    if category == "explain":
        return (f"Explain what this function from {where} does: its inputs, what it returns, and how it works, step "
                f"by step. Point out one edge case it handles.\n\n{_block(fn)}", "explain")
    if category == "test":
        return (f"Write pytest unit tests for this function from {where}, imported with `from {fn.module} import "
                f"{fn.name}`. Cover typical inputs and at least two edge cases, one test function per case.\n\n"
                f"{_block(fn)}", "test")
    kind, instruction = rng.choice(edit_tasks(fn))
    return (f"Here is a function from {where}:\n\n{_block(fn)}\n\n{instruction} Return the whole function.", kind)


def build_prompts(seed: int = 0, per_category: int = PER_CATEGORY,
                  modules: tuple[str, ...] = SOURCE_MODULES) -> list[dict]:
    """The workload's prompt records (module docstring), categories in CATEGORIES order; deterministic in (seed,
    the interpreter's standard library)."""
    pool, _ = candidates(modules)
    rng = random.Random(seed)
    rng.shuffle(pool)
    taken: dict[str, list[SourceFunction]] = {c: [] for c in CATEGORIES}
    used, per_module = set(), dict.fromkeys(modules, 0)
    for round_ in range(per_category):
        for category in CATEGORIES:
            for fn in pool:
                key = (fn.module, fn.name)
                if key not in used and per_module[fn.module] < PER_MODULE and _fits(fn, category):
                    used.add(key)
                    per_module[fn.module] += 1
                    taken[category].append(fn)
                    break
    records = []
    for category in CATEGORIES:
        for i, fn in enumerate(taken[category]):
            text, kind = prompt_text(fn, category, random.Random(f"{seed}:{fn.module}.{fn.name}"))
            records.append({"question_id": f"code-{category}-{i:02d}", "category": category, "turns": [text],
                            "source": f"{fn.module}.{fn.name}", "task": kind})
    return records


def describe(seed: int, records: list[dict], modules: tuple[str, ...] = SOURCE_MODULES) -> dict:
    """What the report says about the workload: where its functions came from and a digest of the prompts."""
    missing = [m for m in modules if module_source(m) is None]
    digest = hashlib.sha256("\n".join(json.dumps(r, sort_keys=True) for r in records).encode()).hexdigest()
    return {"name": "code", "seed": seed, "python": platform.python_version(),
            "source": f"module-level functions of {len(modules) - len(missing)} pure-Python standard-library modules "
                      f"of CPython {platform.python_version()} (bench/code_workload.py SOURCE_MODULES), read with ast",
            "modules_without_source": missing, "prompts": len(records), "sha256": digest}


def write_code_prompts(out: Path, seed: int = 0, per_category: int = PER_CATEGORY) -> tuple[Path, dict]:
    """Write the workload's prompts to `out` (JSON lines) -> (the file, `describe`'s record)."""
    records = build_prompts(seed, per_category)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return out, describe(seed, records)
