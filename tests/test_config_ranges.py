"""What one key may hold is declared on its field (``actors/runtime/config/constraints.py``):
decoding refuses a bad value naming its full key path, in the words the checks use; the
hand-written checks keep what spans keys or looks at the world; path fields are one type."""

from __future__ import annotations

import ast
import subprocess
import sys
import typing

import msgspec
import pytest

from actors.job.config.load import _absolute_paths, load_topology
from actors.runtime.config import ConfigError, Topology, constraints
from tests.jobs import ROOT

# alias -> (an override breaking it, the error it gives); every alias has a row
ALIASES = {
    "PositiveInt": ("learner.total_steps=0", "learner.total_steps: must be >= 1 (got 0)"),
    "NonNegInt": ("sampler.top_k=-1", "sampler.top_k: must be >= 0 (got -1)"),
    "PositiveFloat": ("learner.lr=0.0", "learner.lr: must be > 0 (got 0.0)"),
    "NonNegFloat": ("sampler.drain_grace_s=-1.5", "sampler.drain_grace_s: must be >= 0 (got -1.5)"),
    "Finite": ("validation.pass_threshold=nan", "validation.pass_threshold: must be finite (got nan)"),
    "PositiveFinite": ("algorithm.correction.is_cap=inf",
                       "algorithm.correction.is_cap: must be > 0 and finite (got inf)"),
    "NonNegFinite": ("teacher.sleep_idle_s=-1.0",
                     "teacher.sleep_idle_s: must be >= 0 and finite (got -1.0)"),
    "Fraction": ("learner.lora.dropout=1.5", "learner.lora.dropout: must be in [0, 1] (got 1.5)"),
    "Share": ("validation.top_p=0", "validation.top_p: must be in (0, 1] (got 0)"),
    "Decay": ("learner.betas=[0.9, 1.0]", "learner.betas[1]: must be in [0, 1) (got 1.0)"),
    "Port": ("learner.master_port=65536", "learner.master_port: must be in [0, 65535] (got 65536)"),
    "Device": ("teacher.device=tpu", "teacher.device: 'tpu' is not auto, cpu, cuda or cuda:N"),
    "PythonName": ("agent.rollout.name=1st", "agent.rollout.name: '1st' is not a Python name"),
    "PythonNameOrUnset": ("agent.env.name=a-b", "agent.env.name: 'a-b' is not a Python name"),
}
LIST_ITEM = ("reward.functions=[{builtin='gsm8k'}, {builtin='math', weight=nan}]",
             "reward.functions[1].weight: must be finite (got nan)")
OTHERS = [  # one_of, patterns of their own, list items, nested sections, a required key
    ("task.name=chess", "task.name: 'chess' is not one of arithmetic, repeat_letter, calculator"),
    ("agent.tools=[{builtin='abacus'}]",
     "agent.tools[0].builtin: 'abacus' is not one of calculator, python"),
    ("task.datasets=[{path='d.csv'}]", "task.datasets[0].path: 'd.csv' is neither .parquet nor "
                                       ".jsonl"),
    ("reward.models=[{kind='reward_model', name='a b'}]",
     "reward.models[0].name: 'a b' is not a pool name"),
    ("reward.models=[{kind='judge', name='p', device='auto'}]",
     "reward.models[0].device: 'auto' is not cpu, cuda or cuda:N"),
    ("reward.models=[{kind='reward_model', name='p', replicas=0}]",
     "reward.models[0].replicas: must be >= 1 (got 0)"),
    ("reward.models=[{kind='reward_model', path='m'}]", "reward.models[0].name: must be set"),
    ("reward.models=[{kind='judge', name='p', max_tokens=0}]",  # a field of one kind
     "reward.models[0].max_tokens: must be >= 1 (got 0)"),
    ("reward.models=[{name='p'}]", "reward.models[0].kind: must be set"),
    ("security.server_key=abc", "security.server_key: 'abc' is not a 40-character Z85 key"),
    LIST_ITEM,
    ("algorithm.adv_estimator={name='gdpo', gdpo_reward_keys=['a', 'b'], "
     "gdpo_reward_weights=[1.0, inf]}",
     "algorithm.adv_estimator.gdpo_reward_weights[1]: must be finite (got inf)"),
    ("algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.horizon: must be >= 1 (got 0)"),
    ("router.threads=0", "router.threads: must be >= 1 (got 0)"),
    ("reward.max_error_share=1.5", "reward.max_error_share: must be in [0, 1] (got 1.5)"),
]


def test_every_alias_has_a_case():
    aliases = {name for name, value in vars(constraints).items()
               if typing.get_origin(value) is typing.Annotated
               and name not in ("FilePath", "ModelPath")}  # paths: no range to refuse
    assert aliases == set(ALIASES)


@pytest.mark.parametrize(("override", "message"), [*ALIASES.values(), *OTHERS],
                         ids=[o.split("=")[0] for o, _ in [*ALIASES.values(), *OTHERS]])
def test_a_value_outside_its_field_names_the_full_key(override, message):
    with pytest.raises(ConfigError) as caught:
        load_topology(ROOT / "topology.toml", [override])
    assert str(caught.value) == message or str(caught.value).startswith(message + " ("), \
        str(caught.value)


@pytest.mark.parametrize(("override", "message"), [ALIASES["PositiveInt"], LIST_ITEM])
def test_the_check_verb_prints_the_key_and_exits_2(override, message):
    done = subprocess.run([sys.executable, "runner.py", "check", "topology.toml", override],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"error: bad topology: {message}"


def test_the_default_topology_holds_every_constraint():
    """msgspec does not check defaults: a round trip through the decoder does."""
    default = Topology()
    assert msgspec.convert(msgspec.to_builtins(default), Topology) == default


# -- the checks keep what spans keys or looks at the world -----------------------------------

CHECK_FILES = ["actors/job/config/checks.py", "actors/job/config/agent_checks.py",
               "actors/job/config/hosts.py", "actors/runtime/config/placement.py",
               "actors/runtime/config/pools.py", "actors/runtime/config/teacher.py",
               *(f"actors/runtime/config/{m}.py" for m in (  # the sections' with checks
                   "run", "data", "reward", "learner", "security", "topology")),
               "actors/runtime/config/algorithm.py", "actors/runtime/config/agent.py"]
# keys whose one-key need stays, and why
KEPT = {"'learner.node_rank'": "with [hosts] --host sets it: 0 is the only value to write"}


def _number(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def _one_key_test(node: ast.expr) -> str | None:
    """The key a range test of one value reads (``0 < s.top_p <= 1``, ``math.isfinite(x.w)``,
    ``x.name.isidentifier()``), or None."""
    if isinstance(node, ast.Compare):
        values = [o for o in (node.left, *node.comparators) if not _number(o)]
        if len(values) == 1 and isinstance(values[0], ast.Attribute | ast.Name):
            return ast.unparse(values[0])
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if ast.unparse(node.func) == "math.isfinite" and len(node.args) == 1:
            return ast.unparse(node.args[0])
        if node.func.attr == "isidentifier" and not node.args:
            return ast.unparse(node.func.value)
    return None


def single_key_ranges(source: str) -> list[str]:
    """The ``need(...)`` calls whose condition only tests one value against constants."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "need" and len(node.args) >= 2):
            continue
        cond = node.args[0]
        parts = cond.values if isinstance(cond, ast.BoolOp) and isinstance(cond.op, ast.And) \
            else [cond]
        keys = {_one_key_test(p) for p in parts}
        key = ast.unparse(node.args[1])
        if len(keys) == 1 and None not in keys and key not in KEPT:
            found.append(ast.unparse(node))
    return found


def test_the_scan_finds_a_range_need():
    for line in ["need(s.top_k >= 0, 'sampler.top_k', 'must be >= 0')",
                 "need(0 < s.top_p <= 1, 'sampler.top_p', 'must be in (0, 1]')",
                 "need(reuse >= 1, 'replay.reuse', 'must be >= 1')",
                 "need(math.isfinite(d.weight) and d.weight > 0, 'w', 'must be > 0')",
                 "need(fn.name.isidentifier(), 'n', 'is not a Python name')",
                 "need(x.t > -1.5, 'x.t', 'must be > -1.5')"]:
        assert single_key_ranges(line) == [line], line
    for line in ["need(L.node_rank < L.nnodes, 'learner.node_rank', 'in range')",
                 "need(R.memory_mb == 0 or R.memory_mb >= 128, 'reward.memory_mb', 'm')",
                 "need(problem is None, 'sampler.engine', 'p')"]:
        assert single_key_ranges(line) == [], line


@pytest.mark.parametrize("path", CHECK_FILES)
def test_no_check_restates_a_range_its_field_declares(path):
    source = (ROOT / path).read_text()
    assert "need(" in source
    assert single_key_ranges(source) == [], "declare it on the field (constraints.py)"


# -- paths -----------------------------------------------------------------------------------

PATH_KEYS = {"task.datasets[].path", "validation.datasets[].path", "reward.functions[].path",
             "reward.models[].path", "reward.models[].function_path", "agent.tools[].path",
             "agent.env.path", "security.keys_dir", "security.authorized_keys",
             "model.path", "teacher.path",
             # relative to the topology file's directory (load.py) where one is read
             "algorithm.policy_loss.path", "algorithm.adv_estimator.path",
             "task.datasets[].verifiers.path", "validation.datasets[].verifiers.path"}  # ModelPath: a directory, or "default" (the embedded)


def path_keys(t: msgspec.inspect.Type, prefix: str = "") -> set[str]:
    """The keys of the schema whose type is a ``FilePath`` or a ``ModelPath``."""
    if isinstance(t, msgspec.inspect.Metadata):
        if (t.extra or {}).get("path"):
            return {prefix}
        t = t.type
    if isinstance(t, msgspec.inspect.StructType):
        return set().union(*(path_keys(f.type, f"{prefix}.{f.encode_name}".lstrip("."))
                             for f in t.fields))
    if isinstance(t, msgspec.inspect.ListType):
        return path_keys(t.item_type, prefix + "[]")
    if isinstance(t, msgspec.inspect.UnionType):  # the kinds of [[reward.models]]
        return set().union(*(path_keys(member, prefix) for member in t.types))
    return set()


def test_the_path_fields_are_the_ones_made_absolute():
    assert path_keys(msgspec.inspect.type_info(Topology)) == PATH_KEYS
    relative = {"task": {"datasets": [{"path": "d.jsonl"}]},
                "validation": {"datasets": [{"path": "v.jsonl"}]},
                "algorithm": {"policy_loss": {"name": "custom", "path": "l.py", "function": "f"},
                              "adv_estimator": {"name": "custom", "path": "a.py",
                                                "function": "f"}},
                "reward": {"functions": [{"path": "f.py"}],
                           "models": [{"kind": "judge", "name": "p", "path": "rm",
                                       "function_path": "j.py"}]},
                "security": {"curve": True, "keys_dir": "keys", "authorized_keys": "a.key"},
                "model": {"path": "m"}, "teacher": {"path": "m"},
                "run": {"dir": "runs/x", "socket_dir": "s"}}
    # tools, an environment and a rollout function exclude each other, as a dataset's file and
    # its verifiers environment do: one topology each
    variants = [{"agent": {"tools": [{"path": "t.py", "name": "t"}]}},
                {"agent": {"env": {"path": "e.py", "name": "E"}}},
                {"agent": {"rollout": {"path": "r.py", "branches": "last"}}},
                {"task": {"datasets": [{"verifiers": {"path": "te.py"}}]},
                 "validation": {"datasets": [{"verifiers": {"path": "ve.py"}}]}}]

    def leaves(value, prefix=""):
        if isinstance(value, dict):
            return {k: v for key, item in value.items()
                    for k, v in leaves(item, f"{prefix}.{key}".lstrip(".")).items()}
        if isinstance(value, list):
            return {k: v for item in value for k, v in leaves(item, prefix + "[]").items()}
        return {prefix: value}

    changed = {}  # key -> (as given, made absolute), over the three topologies
    for variant in variants:
        before = msgspec.convert({**relative, **variant}, Topology)
        old = leaves(msgspec.to_builtins(before))
        new = leaves(msgspec.to_builtins(_absolute_paths(before)))
        changed |= {k: (old[k], new[k]) for k in old if old[k] != new[k]}
    assert set(changed) == PATH_KEYS
    assert all(b.startswith("/") and b.endswith(a) for a, b in changed.values())


def _unbounded(t, path: str, out: list[str]) -> None:
    import msgspec.inspect as mi

    if isinstance(t, mi.StructType):
        for f in t.fields:
            _unbounded(f.type, f"{path}.{f.name}" if path else f.name, out)
    elif isinstance(t, mi.UnionType):
        for member in t.types:
            _unbounded(member, path, out)
    elif isinstance(t, mi.ListType):
        _unbounded(t.item_type, f"{path}[]", out)
    elif isinstance(t, mi.DictType):
        _unbounded(t.value_type, f"{path}{{}}", out)
    elif isinstance(t, mi.IntType | mi.FloatType) and all(
            getattr(t, k) is None for k in ("gt", "ge", "lt", "le")):
        out.append(path)


def test_every_numeric_key_declares_its_range_on_its_field():
    """Every int and float of the topology has its bounds on its field (a constraint type of
    ``constraints.py``), so a bad value is refused as it is decoded; the free-form ``kwargs``
    of user functions and the runner's own ``placement`` are the exceptions."""
    import msgspec.inspect as mi

    found: list[str] = []
    _unbounded(mi.type_info(Topology), "", found)
    assert [p for p in found if not p.endswith("kwargs{}") and not p.startswith("placement[]")] \
        == []
