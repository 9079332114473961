"""The shape of the tree: no import circles, small files, light actors, every TOML parses.

The import graph is read from the source (``ast``), with function-level imports counted (they
run too) and ``if TYPE_CHECKING:`` blocks left out (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "messages", "kernels")
MAX_LINES = 450  # actors/ and runner.py: a file past this is a sign to split it


def sources() -> dict[str, Path]:
    """Module name -> file, for every module of the project."""
    out = {"runner": ROOT / "runner.py"}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: those under ``if TYPE_CHECKING:`` are skipped."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append(child)
            visit(child)

    visit(tree)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = sources()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package up
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from pkg import module`` imports the module; ``from module import name`` it
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            connect(v)
    return out


def test_the_graph_sees_real_imports():
    graph = import_graph()
    assert "actors.runtime.config.schema" in graph["actors.job.config.checks"]
    assert "actors.replay.state" in graph["actors.replay.actor"]
    assert "kernels.logprobs" in graph["actors.sampler.engines.hf"]


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


RUNNER = "actors.job"  # the job's runner: config loading and checks, launch, supervision, ...
# what may drive a job, and so import the runner: the command line, and the offline tools (they
# load a recorded run's topology with overrides, as a start does); tests and bench/ are outside
# the packages read here
DRIVERS = ("runner", "actors.offline")


def runner_importers(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Modules outside the runner (and the drivers) that import a module of the runner."""
    inside = (RUNNER, *DRIVERS)
    return {m: sorted(t for t in targets if t == RUNNER or t.startswith(RUNNER + "."))
            for m, targets in graph.items()
            if not any(m == i or m.startswith(i + ".") for i in inside)
            and any(t == RUNNER or t.startswith(RUNNER + ".") for t in targets)}


def test_no_actor_imports_the_runner():
    """The library every actor process uses (``actors/runtime``) and the actors never import the
    job's runner (``actors/job``), so the runner's parts change without touching what runs
    inside actors."""
    graph = import_graph()
    assert "actors.job.supervisor" in graph["runner"] or "actors.job.launch" in graph["runner"]
    found = runner_importers(graph)
    assert not found, f"modules importing the runner: {found}"
    # the check itself sees an offender
    assert runner_importers({"actors.sampler.x": {"actors.job.processes"}}) == {
        "actors.sampler.x": ["actors.job.processes"]}


def test_an_actor_process_loads_no_runner_module():
    """What ``python -m actors.main`` imports before it starts an actor's body."""
    code = ("import sys, actors.main, actors.runtime.actor, actors.runtime.config; "
            "bad = [m for m in sys.modules if m.startswith('actors.job')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_circle_finder_finds_circles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_file_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in [ROOT / "runner.py", *(ROOT / "actors").rglob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("module", ["actors.replay.actor", "actors.router.actor", "messages.rollout",
                                    "actors.job.supervisor"])
def test_light_processes_never_import_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_every_toml_file_parses_as_a_topology():
    from actors.job.config.load import load_topology

    files = [p for p in ROOT.rglob("*.toml")
             if ".venv" not in p.parts and p.name != "pyproject.toml"]
    assert ROOT / "topology.toml" in files
    for path in files:
        tomllib.loads(path.read_text())
        load_topology(path)
