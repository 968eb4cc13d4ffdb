"""Layers without cycles: the import graph of src/verispec, read from the source (AST, function-level imports
included: a deferred import is still a dependency; type-only ones under `if TYPE_CHECKING:` too: a type-checker and
a reader follow them, so a cycle through one is a cycle), has no cycle and only imports down the layers (`LAYERS`
below); and every module imports on its own, so no import works only by the order of others."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "verispec"

# Lowest first; a module may import its own layer and the layers below, never above. Prefixes of dotted names.
LAYERS = [
    ("core", ["config", "sampling", "stats"]),
    ("runtime", ["runtime"]),
    ("drafters", ["drafters"]),
    ("engine", ["engine"]),
    ("apps", ["generator", "server", "cli", "bench", "distill", "__init__", "__main__"]),
]

# Inside runtime/, the same rule between its rooms: kernels, weights, caches and threads below the models (model/:
# architectures, building, twins, loading), the models below the runners that run them (runners/).
RUNTIME_LAYERS = [
    ("runtime parts", ["runtime.kernels", "runtime.weights", "runtime.caches", "runtime.threads", "runtime"]),
    ("runtime.model", ["runtime.model"]),
    ("runtime.runners", ["runtime.runners"]),
]


def module_names(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    files = sorted((src / package).rglob("*.py"))
    return {".".join(f.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): f for f in files}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(src: Path = SRC, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (a name imported from a package counts as its submodule):
    every import statement, at any depth (in functions, under `if TYPE_CHECKING:`)."""
    modules = module_names(src, package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path.name == "__init__.py", node)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def layer_of(module: str, layers: list = LAYERS) -> int:
    rest = module.removeprefix(PACKAGE + ".") if module != PACKAGE else "__init__"
    matches = [(len(p), index) for index, (_, prefixes) in enumerate(layers) for p in prefixes
               if rest == p or rest.startswith(p + ".")]  # the longest prefix decides (runtime.model over runtime)
    if matches:
        return max(matches)[1]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def upward_imports(graph: dict[str, set[str]], layers: list) -> list[str]:
    """Every import from a module to one in a higher layer (modules outside `layers`' prefixes ignored)."""
    def inside(m: str) -> bool:
        rest = m.removeprefix(PACKAGE + ".")
        return any(rest == p or rest.startswith(p + ".") for _, prefixes in layers for p in prefixes)

    return [f"{m} ({layers[layer_of(m, layers)][0]}) imports {d} ({layers[layer_of(d, layers)][0]})"
            for m, deps in sorted(graph.items()) if inside(m) for d in sorted(deps)
            if inside(d) and layer_of(d, layers) > layer_of(m, layers)]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_graph_sees_function_level_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    # the walk reads imports inside functions: the server's app builds its runtime lazily
    assert any(import_graph().values())


def test_a_cycle_through_a_type_only_import_is_caught(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from .b import B\n\nA = 1\n")
    (tmp_path / "pkg" / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                           "    from .a import A\n\nB = 2\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg.a", "pkg.b", "pkg.a"]
    (tmp_path / "pkg" / "b.py").write_text("B = 2\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_imports_only_go_down_the_layers():
    upward = upward_imports(import_graph(), LAYERS)
    assert not upward, "imports going up the layers:\n" + "\n".join(upward)


def test_runtimes_rooms_import_only_down():
    upward = upward_imports(import_graph(), RUNTIME_LAYERS)
    assert not upward, "imports going up runtime's rooms:\n" + "\n".join(upward)


def test_the_rooms_check_catches_a_model_that_imports_its_runner():
    """Negative control: the old two-way (model/native_lm importing runners/native) is an upward import."""
    graph = {"verispec.runtime.model.native_lm": {"verispec.runtime.runners.native"},
             "verispec.runtime.runners.native": {"verispec.runtime.model.llama"}}
    assert upward_imports(graph, RUNTIME_LAYERS) == [
        "verispec.runtime.model.native_lm (runtime.model) imports verispec.runtime.runners.native (runtime.runners)"]


# Run with `python -c` in a fresh interpreter, which has loaded only what start-up loads: the driver uses os and sys
# alone (both loaded at start-up) and builtins, so the state it forks from is a fresh process's.
_DRIVER = r"""
import os, sys

results, jobs, preload, top, names = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]
for module in filter(None, preload.split(",")):
    __import__(module)
tokens_r, tokens_w = os.pipe()  # a jobserver: at most `jobs` imports run at once, in any process of the tree
os.write(tokens_w, b"x" * jobs)
children = {}
for name in names:
    children.setdefault(name.rpartition(".")[0], []).append(name)


def failed(name, text):
    with open(os.path.join(results, name), "a") as out:
        out.write(text)


def checked(name):
    with open(os.path.join(results, ".checked"), "a") as out:  # O_APPEND: one short line lands whole
        out.write(name + "\n")


def visit(package):
    # This process has just imported `package`, as a fresh process importing any module under it would have.
    pids = {}
    for name in children.get(package, []):
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            os.read(tokens_r, 1)
            try:
                checked(name)
                __import__(name)
            except BaseException:
                import traceback

                failed(name, name + ":\n" + traceback.format_exc(limit=-3))
                code = 1
            finally:
                os.write(tokens_w, b"x")
            if code == 0 and name in children:
                code = visit(name)
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
        pids[pid] = name
    worst = 0
    for pid, name in pids.items():
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if status not in (0, 1) or (status == 1 and not os.path.exists(os.path.join(results, name))
                                    and name not in children):
            failed(name, f"{name}: its import process ended with status {status}\n")
        worst = max(worst, status != 0)
    return worst


try:
    checked(top)
    __import__(top)
except BaseException:
    import traceback

    failed(top, top + ":\n" + traceback.format_exc(limit=-3))
else:
    visit(top)
"""


def failures_importing_alone(src: Path, package: str, names: list[str], jobs: int = 2, preload: str = "") -> str:
    """Whether each module of `names` imports on its own, as in a fresh `python -c "import NAME"`, checked for every
    module at a fraction of a process per module: a fresh interpreter imports the package, then forks one process per
    module or subpackage under it (a subpackage's process imports it, then forks its own modules'), `jobs` imports at
    a time. Importing a.b.c imports a, then a.b, then a.b.c, so a process forked after a.b imported holds what a fresh
    process importing a.b.c would hold at that point: nothing of other modules, whether ours or a third party's.
    Returns the failures' tracebacks ('' when none)."""
    names = {".".join(name.split(".")[:i]) for name in names for i in range(1, name.count(".") + 2)}  # + parents
    with tempfile.TemporaryDirectory() as results:
        result = subprocess.run([sys.executable, "-c", _DRIVER, results, str(jobs), preload, package,
                                 *sorted(names - {package})],
                                capture_output=True, text=True, cwd=results, timeout=600,
                                env={**os.environ, "PYTHONPATH": str(src)})
        assert result.returncode == 0, result.stderr
        failures = sorted(set(os.listdir(results)) - {".checked"})
        text = "\n".join((Path(results) / name).read_text() for name in failures).strip()
        tried = (Path(results) / ".checked").read_text().split()
        # every module tried exactly once (below a package that failed, nothing is: that package's failure says so)
        assert sorted(tried) == sorted(n for n in names if not any(n.startswith(f + ".") for f in failures)), tried
        return text


def test_an_order_dependent_import_is_caught(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "b.py").write_text("import pkg\nY = pkg.a.X\n")  # works only once pkg.a was imported
    assert failures_importing_alone(tmp_path, "pkg", ["pkg.a", "pkg.b"]).startswith("pkg.b:")
    assert failures_importing_alone(tmp_path, "pkg", ["pkg.a"]) == ""


def test_a_module_leaning_on_another_modules_third_party_import_is_caught(tmp_path):
    """A fresh process per module, not our modules dropped between imports in one: xml.dom, imported by pkg.a, would
    stay loaded for pkg.b there."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "a.py").write_text("import xml.dom\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("import xml\nNODE = xml.dom.Node\n")  # only after xml.dom
    (tmp_path / "pkg" / "sub" / "c.py").write_text("import sys\nsys.exit(3)\n")  # a module that ends its process
    failures = failures_importing_alone(tmp_path, "pkg", ["pkg.sub", "pkg.sub.a", "pkg.sub.b", "pkg.sub.c"])
    assert failures.startswith("pkg.sub.b:") and "AttributeError" in failures and "pkg.sub.c:" in failures
    assert "pkg.sub.a" not in failures
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("raise ImportError('planted')\n")
    assert "planted" in failures_importing_alone(tmp_path, "pkg", ["pkg.sub", "pkg.sub.a"])


@pytest.mark.slow  # a process per module, ~15-35 s: run by .ci/run (the planted-failure check above stays in make test)
def test_every_module_imports_on_its_own():
    """torch, transformers and numpy are imported before the package (`preload`): most modules' first imports, ~1.5 s
    a process that the lazy package __init__ no longer shares. Each brings its own submodules (transformers lazily:
    none), so a module leaning on a submodule that another module imported is still caught."""
    names = sorted(name for name in module_names() if not name.endswith("__main__"))  # those run a command
    failures = failures_importing_alone(SRC, PACKAGE, names, preload="torch,transformers,numpy")
    assert not failures, failures
