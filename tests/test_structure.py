"""The shape of the tree: no import circles, one concern per module, light actors, every TOML
parses, each variant named only in its own file and its table's row, rows that name code as code,
no forwarding modules, and "pool" and "replay" each naming one thing.

The import graph is read from the source (``ast``), with function-level imports counted (they
run too: a table's row loads its variant's code inside a function) and ``if TYPE_CHECKING:``
blocks left out (they never run). The config is the lowest floor: its modules import no actor
package at their top, and a row of the config reaches its variant's code only through its
``load`` method (an engine's file, an estimator's kernel); the circle finder counts those
imports, so a variant's code never imports the config's package back.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "messages", "kernels")
SIZE_ALARM = 600  # actors/ and runner.py: a file past this likely holds a second concern
FUNCTION_ALARM = 60  # actors/: a function past this is a list of phases that want names
CONFIG = "actors.runtime.config"
# what the config may import besides itself: libraries of its own floor (the weights transports'
# table: names and rows, torch-free, its rows loading a transport's file only when called)
CONFIG_MAY_IMPORT = ("actors.runtime.transports.table",)


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


def _runtime_imports(tree: ast.AST, deferred: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: those under ``if TYPE_CHECKING:`` are skipped, and
    with ``deferred`` those inside functions."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if deferred and isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append(child)
            visit(child)

    visit(tree)
    return found


def import_graph(deferred: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """Module -> the modules it imports (not counting the function-level imports of the modules
    ``deferred``: only the circle finder's own test leaves some out)."""
    modules = sources()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path)), name in deferred):
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
    assert "actors.runtime.config" in graph["actors.job.config.checks"]
    assert "actors.replay.state" in graph["actors.replay.actor"]
    assert "kernels.logprobs" in graph["actors.sampler.engines.hf"]


def test_no_import_circles():
    """Deferred imports included: a variant's code loaded when its row is called counts."""
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)
    # the graph counts a row's import of its variant's code, made inside a function
    rows = f"{CONFIG}.engines"
    assert "actors.sampler.engines.hf" in import_graph()[rows]
    assert "actors.sampler.engines.hf" not in import_graph(deferred=(rows,))[rows]


def config_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Modules of the config and what they import above its floor."""
    out = {}
    for module, targets in graph.items():
        if module == CONFIG or module.startswith(CONFIG + "."):
            above = sorted(t for t in targets if t.startswith("actors.")
                           and not (t == CONFIG or t.startswith(CONFIG + "."))
                           and t not in CONFIG_MAY_IMPORT)
            if above:
                out[module] = above
    return out


# the config's modules a module outside it may import directly: those the config's own table
# imports (the weights transports import devices), which its package would make a circle
CONFIG_FLOOR = {"actors.runtime.devices"}


def test_outside_the_config_its_package_is_the_one_way_in():
    """A module outside ``actors/runtime/config`` imports the config's names from its package
    (``from actors.runtime.config import X``), never from one of its modules."""
    graph = import_graph()
    found = sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                   if t.startswith(f"{CONFIG}.") and not m.startswith(CONFIG)
                   and m not in CONFIG_FLOOR)
    assert not found, found
    assert "actors.runtime.config.gpus" in graph["actors.runtime.devices"]  # (the check sees)


def test_the_config_imports_no_actor_package():
    """Configuration is the lowest floor: a section's options, a variant's row and a check live
    in ``actors/runtime/config`` (or a torch-free table of its floor), never in an actor's
    package, whose code reads the config. The one way up is a row's ``load``, which imports its
    variant's code when called (``test_a_config_row_loads_its_code_only_in_load``)."""
    top = import_graph(deferred=tuple(m for m in sources() if m.startswith(CONFIG)))
    assert not config_imports(top), config_imports(top)
    assert config_imports({f"{CONFIG}.schema": {"actors.sampler.engines.hf", "kernels.x",
                                                f"{CONFIG}.agent"}}) == {
        f"{CONFIG}.schema": ["actors.sampler.engines.hf"]}



def loads_above_the_config(path: Path) -> list[str]:
    """The imports of an actor package above the config made inside functions of ``path`` (a
    config module) other than a row's ``load``, as "line: module"."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inside = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) \
                else function
            if isinstance(child, ast.ImportFrom) and function and function != "load":
                module = child.module or ""
                if module.startswith("actors.") and not module.startswith(CONFIG):
                    found.append(f"{child.lineno}: {module}")
            visit(child, inside)

    visit(ast.parse(path.read_text()), "")
    return found


def test_a_config_row_loads_its_code_only_in_load(tmp_path):
    """A row of the config reaches its variant's code (above the config) only in its ``load``:
    one convention for every kind, and no other function of the config climbs a floor."""
    config = ROOT / "actors/runtime/config"
    found = {str(p.relative_to(ROOT)): f for p in config.rglob("*.py")
             if (f := loads_above_the_config(p))}
    assert not found, found
    assert "actors.sampler.engines.hf" in import_graph()[f"{CONFIG}.engines"]  # (the loads)
    probe = tmp_path / "rows.py"  # the check sees an import in another method
    probe.write_text("class R:\n    def start(self):\n        from actors.sampler.engines.hf import start\n")
    assert loads_above_the_config(probe) == ["3: actors.sampler.engines.hf"]


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


def product_files() -> list[Path]:
    return [ROOT / "runner.py", *(ROOT / "actors").rglob("*.py")]


def test_each_module_says_its_one_concern_and_none_is_huge():
    """Modules split where concerns split, not at a line count: every module opens with the
    docstring that says what it holds (an empty package marker aside), and a file past
    ``SIZE_ALARM`` lines is an alarm to look for the second concern in it."""
    unsaid = [str(p.relative_to(ROOT)) for p in product_files()
              if p.read_text().strip() and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not unsaid, f"modules without a docstring saying what they hold: {unsaid}"
    long = {str(p.relative_to(ROOT)): n for p in product_files()
            if (n := len(p.read_text().splitlines())) > SIZE_ALARM}
    assert not long, f"over {SIZE_ALARM} lines (more than one concern?): {long}"


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of each function or method in ``source`` longer than ``limit`` lines."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno is not None
            and n.end_lineno - n.lineno + 1 > limit]


def test_no_function_in_actors_is_a_long_list_of_phases():
    """A function that runs through phases reads as its outline, each phase a named function
    (``launch._run``, ``layout.place``, ``Policy.__init__``)."""
    long = {f"{p.relative_to(ROOT)}:{name}": n for p in (ROOT / "actors").rglob("*.py")
            for name, n in long_functions(p.read_text(), FUNCTION_ALARM)}
    assert not long, f"functions over {FUNCTION_ALARM} lines: {long}"


def test_the_long_function_finder_counts_the_lines_of_each_function():
    body = "".join(f"        x{i} = {i}\n" for i in range(4))
    source = f"class C:\n    def short(self):\n{body}\n    async def long(self):\n{body}{body}"
    assert long_functions(source, 5) == [("long", 9)]


def variant_homes() -> dict[str, tuple[Path, ...]]:
    """Each engine, transport, advantage estimator and policy loss name -> where it may be
    spelled: its own file (or folder) and its table, whose row says what differs between the
    variants (an engine's row, options and loader are in the config; a transport's receiving half may be in an engine whose workers receive it; an
    estimator's or a loss's own file is its kernel, outside ``actors/``, its row
    in the config)."""
    from actors.runtime.config import ENGINES
    from actors.runtime.config.estimators import ROWS as ESTIMATORS
    from actors.runtime.config.losses import ROWS as LOSSES
    from actors.runtime.transports.table import TRANSPORTS

    engines, transports = ROOT / "actors/sampler/engines", ROOT / "actors/runtime/transports"
    config = ROOT / "actors/runtime/config"
    homes = {n: (engines / n, engines / f"{n}.py", config / "engines.py") for n in ENGINES}
    # a transport's receiving half in an engine's workers: that engine's ``receive.py``
    receiving = tuple(engines.glob("*/receive.py"))
    homes.update({n: (transports / f"{n}.py", transports / "table.py", *receiving)
                  for n in TRANSPORTS})
    for names, row in ((ESTIMATORS, config / "estimators.py"), (LOSSES, config / "losses.py")):
        for n in names:
            homes[n] = (*homes.get(n, ()), row)
    return homes


def stray_names(source: str, path: Path, homes: dict[str, tuple[Path, ...]]) -> list[str]:
    """Variant names written as string literals in ``source`` (the file ``path``) outside their
    homes; docstrings and comments may name them (an error message names the key instead), and
    type annotations (``Literal["ratio", "geo_mean"]``: a value of another key that happens to
    share a variant's name)."""
    tree = ast.parse(source)
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    docs |= {id(c) for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
             for c in ast.walk(n.annotation)}
    return [f"{path.relative_to(ROOT)}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            and n.value in homes and not any(path == h or h in path.parents
                                             for h in homes[n.value])]


def test_a_variant_is_named_only_in_its_own_file_and_its_row():
    """A choice made by a string in several files is what the tables replace: the rest of the
    product reads a variant's row (``ENGINES[name].sleeps``, ``TRANSPORTS[name].gpu``,
    ``algorithm.adv_estimator.critic``, ``algorithm.policy_loss.takes_correction``)."""
    homes = variant_homes()
    assert all(any(h.exists() for h in own) for own in homes.values())
    found = [s for p in product_files() for s in stray_names(p.read_text(), p, homes)]
    assert not found, f"variant names outside their files and rows: {found}"
    # the check itself sees an offender, and lets a variant's own file and its row name it
    checks = ROOT / "actors/job/config/checks.py"
    assert stray_names('if engine == "vllm": pass', checks, homes) == [
        "actors/job/config/checks.py:1: 'vllm'"]
    assert not stray_names('"""Docs may say vllm."""\nx = "vllm"',
                           ROOT / "actors/sampler/engines/vllm/engine.py", homes)
    assert not stray_names('x = "nccl"', ROOT / "actors/runtime/transports/table.py", homes)
    trainer = ROOT / "actors/learner/trainer.py"
    assert stray_names('if algo.adv_estimator.name == "remax": pass', trainer, homes) == [
        "actors/learner/trainer.py:1: 'remax'"]
    assert not stray_names('mode: Literal["a", "gae"] = "a"', trainer, homes)


CODE_BY_NAME = re.compile(r"(actors|messages|kernels)(\.\w+)+:\w+")  # "module:function"


def test_rows_name_code_as_code():
    """A table's row holds a function (importing its variant when called, where a light actor
    must not import torch), which mypy and go-to-definition follow; never ``module:function``."""
    from actors.registry import KINDS
    from actors.runtime.config import ENGINES, FALLBACK, EngineRow
    from actors.runtime.transports.table import TRANSPORTS

    found = [f"{p.relative_to(ROOT)}:{n.lineno}: {n.value!r}" for p in product_files()
             for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and CODE_BY_NAME.fullmatch(n.value)]
    assert not found, f"code named by a string: {found}"
    assert CODE_BY_NAME.fullmatch("actors.replay.actor:replay_actor")
    assert all(callable(r.problem) for r in ENGINES.values())
    assert all(row.load is not EngineRow.load for row in ENGINES.values())  # each has its own
    assert ENGINES[FALLBACK]().load().__module__ == f"actors.sampler.engines.{FALLBACK}"
    assert all(t.load().sender.name == t.load().receiver.name == n
               for n, t in TRANSPORTS.items())
    assert all(k.load().__name__ == f"{k.name}_actor" for k in KINDS)


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
    "--pool",  # runner.py attach: the pool an attached worker serves
    "actors.runtime.config.pools",  # the router's pools that score a group
}
# "replay" is the replay buffer's (``[replay]``, ``actors/replay/``); the offline tool that
# trains a recorded step again is ``rerun``. Outside the buffer's package, these say replay:
REPLAY_BUFFER_NAMES = {"replay", "FromReplay", "ToReplay", "ReplayConfig", "_replay", "replay_actor",
                       "actors.runtime.config.replay"}  # (the last: its config section's module)


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


# -- folders say what they hold ----------------------------------------------------------------

def package_map() -> tuple[set[str], set[str]]:
    """The actors and the libraries ``actors/__init__.py`` lists, by their folder or module."""
    import actors

    doc = actors.__doc__ or ""
    actor_part, library_part = doc.split("\nLibraries:")
    listed = re.compile(r"^- ``([a-z_]+)(?:/|\.py)``", re.M)
    libraries = set(listed.findall(library_part))
    libraries |= set(re.findall(r"``([a-z_]+)\.py``", library_part))
    return set(listed.findall(actor_part)), libraries


def test_every_folder_under_actors_is_listed_as_an_actor_or_a_library():
    actor_names, library_names = package_map()
    assert not actor_names & library_names
    here = {p.stem for p in (ROOT / "actors").iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py"
                                                                  and p.stem != "__init__")}
    assert here == actor_names | library_names, (
        f"not listed in actors/__init__.py: {sorted(here - actor_names - library_names)}; "
        f"listed but gone: {sorted((actor_names | library_names) - here)}")


def test_each_actor_kind_runs_a_body_from_an_actor_folder():
    from actors.registry import KINDS

    actor_names, _ = package_map()
    for kind in KINDS:
        module = kind.load().__module__  # e.g. actors.learner.actor
        assert module.split(".")[1] in actor_names, (kind.name, module)
