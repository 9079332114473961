"""Property test (hypothesis): any one override of a schema key, with a value of the wrong type
or out of range, either passes every check a start runs (``load_topology`` then ``preflight``:
what ``runner.py check`` does, and what a start does before any actor exists) or is refused
with a ``ConfigError`` whose message begins with a schema key path; a value of the wrong type
is refused naming its own key. Nothing else may escape (no traceback reaches a user).

In-process and bounded: the preflight's child checks are kept per input, so the model and user
code are checked once for all examples; ``tests/test_bad_input.py`` runs the same checks through
``runner.py`` as a subprocess.
"""

from __future__ import annotations

import json
import math
import re

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.job.config.load import load_topology
from actors.job.config.preflight import preflight
from actors.runtime.config import ConfigError, Topology
from tests.jobs import ROOT


def leaves(info: msgspec.inspect.Type, prefix: str = "") -> dict[str, msgspec.inspect.Type]:
    """Every key path of the schema that holds a value (not a table), with its type."""
    out: dict[str, msgspec.inspect.Type] = {}
    for f in info.fields:
        key = f"{prefix}{f.encode_name}"
        if isinstance(f.type, msgspec.inspect.StructType):
            out.update(leaves(f.type, key + "."))
        else:
            out[key] = f.type
    return out


KEYS = leaves(msgspec.inspect.type_info(Topology))
# a key path: task.datasets[0].path; msgspec names a value of a table (hosts) as hosts[...]
KEY_PATH = re.compile(r"([a-z_]+(\[(\d+|\.\.\.)\])?)(\.[a-z_0-9]+(\[(\d+|\.\.\.)\])?)*")


def kinds(t: msgspec.inspect.Type) -> set[str]:
    """The TOML kinds a key accepts."""
    match t:
        case msgspec.inspect.UnionType(types=types):
            return set().union(*(kinds(u) for u in types))
        case msgspec.inspect.Metadata(type=inner):  # a constrained value (a pattern's message)
            return kinds(inner)
        case msgspec.inspect.BoolType():
            return {"bool"}
        case msgspec.inspect.IntType():
            return {"int"}
        case msgspec.inspect.FloatType():
            return {"float", "int"}
        case msgspec.inspect.StrType() | msgspec.inspect.LiteralType():
            return {"str"}
        case msgspec.inspect.NoneType():
            return {"none"}
        case msgspec.inspect.ListType() | msgspec.inspect.TupleType() | msgspec.inspect.VarTupleType():
            return {"list"}
        case msgspec.inspect.DictType() | msgspec.inspect.StructType():
            return {"table"}  # (a section or a row given whole: {} is its defaults)
    return {"other"}


def toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


VALUES = {
    "bool": st.booleans(),
    "int": st.sampled_from([0, -1, -7, 1, 2**31, -(2**40), 10**12]),
    "float": st.sampled_from([0.0, -0.5, -1e9, 1e12, 1.5, float("inf"), float("-inf"),
                              float("nan")]),
    "str": st.sampled_from(["", "abc", "auto", "-", "/nonexistent/x", "tcp://", "ipc://"]),
    "list": st.lists(st.integers(-3, 3) | st.text("ab", max_size=2), max_size=2),
    "table": st.dictionaries(st.sampled_from(["a", "path"]), st.integers(0, 2), max_size=2),
}


@st.composite
def overrides(draw) -> tuple[str, str, bool]:
    """(key, the override text, whether the value's kind is one the key does not accept)."""
    key = draw(st.sampled_from(sorted(KEYS)))
    accepted = kinds(KEYS[key])
    right = sorted(accepted & VALUES.keys())  # half the draws: the right kind, maybe out of range
    kind = draw(st.sampled_from(right if right and draw(st.booleans()) else sorted(VALUES)))
    value = draw(VALUES[kind])
    wrong = kind not in accepted and not (kind == "int" and "float" in accepted)
    return key, f"{key}={toml(value)}", wrong


@pytest.fixture(scope="module")
def base(tiny_model) -> list[str]:
    return [f"model.path={tiny_model}", "sampler.engine=hf", "validation.datasets=[]"]


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=overrides())
def test_any_override_passes_the_checks_or_is_refused_naming_a_key(drawn, base):
    key, text, wrong = drawn
    try:
        preflight(load_topology(ROOT / "topology.toml", [*base, text]))
    except ConfigError as exc:
        message = str(exc)
        named = message.split(": ", 1)[0]
        assert KEY_PATH.fullmatch(named) and named.split(".")[0].split("[")[0] in \
            {k.split(".")[0] for k in KEYS} | {"override"}, (text, message)
        if wrong:
            assert named == key or named.startswith(key + "[") or \
                named.startswith(key + "."), (text, message)
    else:
        assert not wrong, f"{text}: a value of the wrong type was accepted"
