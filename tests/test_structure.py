"""The shape of the tree: no import circles, small files, light actors, every TOML parses, no
forwarding modules, and "pool" and "replay" each naming one thing.

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


# -- one name, one meaning -------------------------------------------------------------------

# "pool" is the router's word: a named set of workers it routes requests to (``reward``, the
# teacher, each served model). These are the names that say it; another thing gets its own word
# (the runner's processes, the sandbox's children, a served model's config), so a name that
# says pool outside this list fails until it is one of these.
ROUTER_POOL_NAMES = {
    "pool",  # the pool a request, a worker or a replica's status names
    "POOL", "RULES_POOL",  # the pool a worker kind serves; the rule workers' pool
    "PoolWorker",  # a worker of one of the router's pools
    "per_pool", "unserved_pools",  # replies per pool (combine); pools waiting for a worker
    "pool_devices",  # the devices of each served model's pool (the runner's layout)
    "--pool",  # runner.py attach: the pool an attached worker serves
    "actors.runtime.config.pools",  # the router's pools that score a group
}
# "replay" is the replay buffer's (``[replay]``, ``actors/replay/``); the offline tool that
# trains a recorded step again is ``rerun``. Outside the buffer's package, these say replay:
REPLAY_BUFFER_NAMES = {"replay", "FromReplay", "ToReplay", "ReplayConfig"}


def names_in(source: str) -> list[str]:
    """The names a module gives: classes, functions, arguments, variables, attributes set,
    keyword arguments, imported names, command-line options."""
    names = []
    for node in ast.walk(ast.parse(source)):
        match node:
            case (ast.FunctionDef(name=name) | ast.AsyncFunctionDef(name=name)
                  | ast.ClassDef(name=name) | ast.arg(arg=name) | ast.keyword(arg=str(name))
                  | ast.Name(id=name, ctx=ast.Store()) | ast.Attribute(attr=name, ctx=ast.Store())):
                names.append(name)
            case ast.alias(name=imported, asname=alias):
                names.append(alias or imported.rpartition(".")[2])
            case ast.Constant(value=str(option)) if option.startswith("--") and " " not in option:
                names.append(option)
    return names


def names_saying(word: str) -> dict[str, set[str]]:
    """Every name of the product (its modules' too) holding ``word`` -> the modules giving it."""
    found: dict[str, set[str]] = {}
    for module, path in sources().items():
        for name in [module, *names_in(path.read_text())]:
            if word in name.lower():
                found.setdefault(name, set()).add(module)
    return found


def test_pool_names_only_the_routers_pools():
    found = {name: sorted(modules) for name, modules in names_saying("pool").items()
             if name not in ROUTER_POOL_NAMES}
    assert not found, f"'pool' naming something other than the router's pools: {found}"
    # the scan sees each kind of name
    assert {"ChildPool", "size", "self", "pools", "--pool", "Pools", "x"} <= set(names_in(
        "from a import Pools\nclass ChildPool:\n    def __init__(self, size):\n"
        "        self.pools = f(x=1, y='--pool')\n"))


def test_replay_names_only_the_replay_buffer():
    found = {name: sorted(m for m in modules if not m.startswith("actors.replay"))
             for name, modules in names_saying("replay").items()
             if name not in REPLAY_BUFFER_NAMES}
    found = {name: modules for name, modules in found.items() if modules}
    assert not found, f"'replay' naming something other than the replay buffer: {found}"


# package faces that pass names on, and why they stay
FACADES = {
    "actors.runtime.config": "the config types' public names, imported by actors and engines",
    "actors.runtime.weights": "its shm names go with the weights transports' own files",
}


def passed_on(source: str) -> list[str]:
    """The names a module imports from the project and never uses: it only passes them on."""
    tree = ast.parse(source)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    return [alias.asname or alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES
            for alias in node.names if (alias.asname or alias.name) not in used]


def test_no_module_passes_names_on():
    """A name is imported from the module that defines it: no forwarding layer between."""
    found = {module: names for module, path in sources().items()
             if module not in FACADES and (names := passed_on(path.read_text()))}
    assert not found, f"modules re-exporting names they do not use: {found}"
    # the check sees an offender
    assert passed_on("from kernels.aggregate import aggregate\n__all__ = ['aggregate']\n") == [
        "aggregate"]
