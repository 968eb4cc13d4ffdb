"""Layers without cycles: the import graph of src/verispec, read from the source (AST, function-level imports
included: a deferred import is still a dependency), has no cycle and only imports down the layers (`LAYERS`
below); and every module imports on its own, so no import works only by the order of others."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

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


def module_names() -> dict[str, Path]:
    files = sorted((SRC / PACKAGE).rglob("*.py"))
    return {".".join(f.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): f for f in files}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def import_graph() -> dict[str, set[str]]:
    """module -> the verispec modules it imports (a name imported from a package counts as its submodule)."""
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or _under_type_checking(node, parents):
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(name, path.name == "__init__.py", node)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def layer_of(module: str) -> int:
    rest = module.removeprefix(PACKAGE + ".") if module != PACKAGE else "__init__"
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(rest == p or rest.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


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


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None, f"import cycle: {' -> '.join(find_cycle(import_graph()))}"


def test_imports_only_go_down_the_layers():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {d} ({LAYERS[layer_of(d)][0]})"
              for m, deps in sorted(import_graph().items()) for d in sorted(deps) if layer_of(d) > layer_of(m)]
    assert not upward, "imports going up the layers:\n" + "\n".join(upward)


def failures_importing_alone(src: Path, package: str, names: list[str]) -> str:
    """One subprocess; each module imported with the package's modules of the previous one dropped first, so a
    module that imports only after another has run fails. Returns the failures' tracebacks ('' when none)."""
    script = (
        "import importlib, sys, traceback\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        f"    for key in [k for k in sys.modules if k == {package!r} or k.startswith({package + '.'!r})]:\n"
        "        del sys.modules[key]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ':\\n' + traceback.format_exc(limit=-3))\n"
        "print('\\n'.join(failed))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(src)}, timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_an_order_dependent_import_is_caught(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "b.py").write_text("import pkg\nY = pkg.a.X\n")  # works only once pkg.a was imported
    assert failures_importing_alone(tmp_path, "pkg", ["pkg.a", "pkg.b"]).startswith("pkg.b:")
    assert failures_importing_alone(tmp_path, "pkg", ["pkg.a"]) == ""


def test_every_module_imports_on_its_own():
    names = sorted(name for name in module_names() if not name.endswith("__main__"))  # those run a command
    failures = failures_importing_alone(SRC, PACKAGE, names)
    assert not failures, failures
