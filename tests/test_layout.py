"""The installed package: one top-level name (``streamrl``), every package folder listed in
pyproject.toml, and no import cycle between its modules."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import streamrl

REPO = Path(__file__).resolve().parents[1]
FOLDERS = (
    "queues", "protocol", "runtime", "config", "cli", "actors", "sandbox", "learner", "inference",
    "domains", "testing",
)


def test_only_streamrl_is_importable_outside_the_checkout(tmp_path: Path) -> None:
    # Given a Python started outside the checkout (isolated: no PYTHONPATH, no user site)
    probe = (
        "import importlib.util, streamrl.queues.streams, streamrl.cli.main\n"
        f"print([n for n in {FOLDERS!r} if importlib.util.find_spec(n) is not None])\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    # Then streamrl.<folder> imports, and none of the folders is a top-level name
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    top = importlib.metadata.distribution("streamrl").read_text("top_level.txt")
    assert top is None or top.split() == ["streamrl"]


def test_the_editable_install_prints_no_layout_notice(tmp_path: Path) -> None:
    # Given the build backend pyproject.toml names, run as pip runs it (backend-path first)
    system = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    paths = [str(REPO / p) for p in system.get("backend-path", [])]
    probe = (
        "import importlib, sys\n"
        f"sys.path[:0] = {paths!r}\n"
        f"backend = importlib.import_module({system['build-backend']!r})\n"
        f"print('built', backend.build_editable({str(tmp_path)!r}))\n"
    )
    # When it builds the editable wheel of `pip install -e .`
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    # Then it builds, without setuptools' notice about folders named like the package
    assert done.returncode == 0, done.stderr[-3000:]
    assert "built streamrl-0.1.0-0.editable" in done.stdout
    assert "Please be careful with folders" not in done.stdout + done.stderr


def test_pyproject_lists_every_package_folder() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {"streamrl"}
    for folder in FOLDERS:
        assert config["package-dir"][f"streamrl.{folder}"] == folder
        for path in (REPO / folder).rglob("*"):
            if path.is_dir() and path.name != "__pycache__" and any(path.iterdir()):
                has_code = (path / "__init__.py").exists()
                data_only = all(p.suffix in (".jsonl", ".json") for p in path.iterdir())
                if has_code or data_only:
                    found.add("streamrl." + ".".join(path.relative_to(REPO).parts))
        found.add(f"streamrl.{folder}")
    assert listed == found


def _modules() -> Iterator[tuple[str, Path]]:
    """Every module of the installed package, by its dotted name."""
    roots = [("streamrl", Path(streamrl.__file__).parent)]
    for folder in FOLDERS:
        module = importlib.import_module(f"streamrl.{folder}")
        roots.append((f"streamrl.{folder}", Path(module.__path__[0])))
    for name, root in roots:
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if name == "streamrl" and len(parts) > 1:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join((name, *parts)), path


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``module`` imports, at any depth of its code (function-local
    imports too), except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    out: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            # "import a.b.c" needs a, a.b and a.b.c; count the deepest module of the package
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_installed_package_has_no_import_cycle() -> None:
    modules = dict(_modules())
    known = set(modules)
    graph = {m: _imports(m, p, known) for m, p in modules.items()}
    # Imports of a package's own __init__ by its modules are how Python loads them, not a
    # dependency between modules: leave the parent-package edges out.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    assert len(modules) > 80
    assert sum(map(len, graph.values())) > 200  # the graph is really read
    assert _cycles(graph) == []


LAYERS = (
    ("streamrl",),  # backoff, net: used by everything
    ("queues", "sandbox"),  # the broker; the sandboxes
    ("protocol",),  # the pipeline's names, messages, roles, over the broker
    ("config", "learner", "domains", "inference"),  # configuration; the libraries actors use
    ("runtime",),  # the serve loop, an actor's context, metrics, logs, process entry
    ("actors",),  # the actors: config + handle
    ("cli",),  # the command, the supervisor (`up`) and the operator tools
)
"""Which way imports flow (docs/architecture.md): a folder imports only from its own layer or
the layers above it in this list."""


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in FOLDERS) else "streamrl"


def test_imports_flow_one_way_between_folders() -> None:
    layer = {folder: i for i, folders in enumerate(LAYERS) for folder in folders}
    assert set(layer) == {"streamrl", *FOLDERS} - {"testing"}
    modules = dict(_modules())
    known = set(modules)
    upward = []
    for module, path in modules.items():
        here = _folder(module)
        if here == "testing" or module == "streamrl.__main__":  # test helpers; `python -m`
            continue
        for dep in _imports(module, path, known):
            there = _folder(dep)
            if there != "testing" and layer[there] > layer[here]:
                upward.append(f"{module} -> {dep}")
    assert upward == []
