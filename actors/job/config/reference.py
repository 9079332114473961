"""The configuration reference, generated from the schema: every key of ``topology.toml`` with
its type, its range or allowed values, its default and its one-line doc.

``python runner.py keys [PREFIX]`` prints it on a terminal; ``python runner.py keys --markdown``
writes ``docs/configuration.md`` (a test fails when that file is stale). The docs are the string
under each field in the config Structs (read from their source: Python keeps no attribute
docstrings), so the reference and the code cannot disagree.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec
from msgspec import inspect as mi

from actors.runtime.config import BIG, Topology


@dataclass(frozen=True)
class Key:
    """One key of the reference."""

    path: str  # dotted, ``[]`` after a list of tables (``reward.functions[].path``)
    type: str  # the value's type, with its range or allowed values
    default: str  # as TOML would spell it ("" when the key must be set)
    doc: str  # the field's docstring, one paragraph


# keys in the schema that the runner fills in for its actors (written to topology.json)
SET_BY_THE_RUNNER = ("placement", "security.server_key")


def keys(root: type = Topology) -> list[Key]:
    """Every leaf key under ``root`` a user sets, in the schema's order."""
    out: list[Key] = []
    _walk(mi.type_info(root), "", out)  # type: ignore[arg-type]  # a Struct: a StructType
    return [k for k in out if not k.path.startswith(SET_BY_THE_RUNNER)]


def _walk(t: mi.StructType, prefix: str, out: list[Key]) -> None:
    docs = field_docs(t.cls)
    for f in t.fields:
        path = f"{prefix}{f.encode_name}"
        inner = _unwrap(f.type)
        if isinstance(inner, mi.StructType):
            _walk(inner, f"{path}.", out)
        elif isinstance(inner, mi.UnionType) and all(isinstance(_unwrap(m), mi.StructType)
                                                     for m in inner.types):
            members = [_unwrap(m) for m in inner.types]  # a tagged union: its tag, then each
            tag = members[0].tag_field                   # member's own keys
            default = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
            out.append(Key(f"{path}.{tag}", " | ".join(json.dumps(m.tag) for m in members),
                           _toml(type(default).__struct_config__.tag), docs.get(f.name, "")))
            for s in members:
                _walk(s, f"{path}[{tag}={s.tag}].", out)
        elif isinstance(inner, mi.UnionType) and len(inner.types) == 2 \
                and isinstance(_unwrap(inner.types[1]), mi.NoneType) \
                and isinstance(_unwrap(inner.types[0]), mi.StructType):
            out.append(Key(path, type_name(f.type), _toml(f.default), docs.get(f.name, "")))
            _walk(_unwrap(inner.types[0]), f"{path}.", out)  # an optional table: its keys too
        elif isinstance(inner, mi.ListType) and isinstance(_unwrap(inner.item_type), mi.StructType):
            _walk(_unwrap(inner.item_type), f"{path}[].", out)
        elif isinstance(inner, mi.ListType) and isinstance(_unwrap(inner.item_type), mi.UnionType) \
                and all(isinstance(_unwrap(m), mi.StructType)
                        for m in _unwrap(inner.item_type).types):
            for member in _unwrap(inner.item_type).types:  # a tagged union: one block per tag
                s = _unwrap(member)
                _walk(s, f"{path}[{s.tag_field}={s.tag}].", out)
        else:
            default = "" if f.required else _toml(f.default if f.default is not msgspec.NODEFAULT
                                                  else f.default_factory())
            out.append(Key(path, type_name(f.type), default, docs.get(f.name, "")))


def _unwrap(t: Any) -> Any:
    return t.type if isinstance(t, mi.Metadata) else t


def type_name(t: Any) -> str:
    """``int >= 1``, ``float in (0, 1]``, ``"a" | "b"``, ``list of str``, ``str (cpu, cuda:N)``."""
    extra = t.extra or {} if isinstance(t, mi.Metadata) else {}
    t = _unwrap(t)
    match t:
        case mi.IntType() | mi.FloatType():
            return f"{'int' if isinstance(t, mi.IntType) else 'float'}{_bounds(t)}"
        case mi.StrType():
            if "bad" not in extra:
                return "str"
            return f"str ({extra.get('shows') or extra['bad'].removeprefix('is not ')})"
        case mi.BoolType():
            return "bool"
        case mi.NoneType():
            return "unset"
        case mi.LiteralType():
            return " | ".join(json.dumps(v) for v in t.values)
        case mi.UnionType():
            return " | ".join(type_name(m) for m in t.types)
        case mi.ListType() | mi.VarTupleType():
            return f"list of {type_name(t.item_type)}"
        case mi.TupleType():
            return f"[{', '.join(type_name(m) for m in t.item_types)}]"
        case mi.DictType():
            return f"table of {type_name(t.key_type)} to {type_name(t.value_type)}"
        case mi.StructType():
            return "table"
    return type(t).__name__.removesuffix("Type").lower()


def _bounds(t: Any) -> str:
    low = (("[", t.ge) if t.ge not in (None, -BIG) else ("(", t.gt) if t.gt is not None else None)
    high = (("]", t.le) if t.le not in (None, BIG) else (")", t.lt) if t.lt is not None else None)
    if low and high:
        return f" in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low:
        return f" {'>=' if low[0] == '[' else '>'} {low[1]:g}"
    if high:
        return f" {'<=' if high[0] == ']' else '<'} {high[1]:g}"
    return ""


def _toml(value: Any) -> str:
    """``value`` as it is written in a topology file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "(unset)"
    if isinstance(value, str):
        return json.dumps(value) if "\n" not in value else '"""…"""'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The string under each field of ``cls`` and of its bases (a docstring the way cleanrl
    and msgspec's own examples write them), joined into one paragraph."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not issubclass(klass, msgspec.Struct) or klass is msgspec.Struct:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def terminal(prefix: str = "") -> str:
    """The reference as plain lines (``runner.py keys [PREFIX]``)."""
    chosen = [k for k in keys() if k.path.startswith(prefix)]
    lines = []
    for k in chosen:
        default = f" = {k.default}" if k.default else " (must be set)"
        lines.append(f"{k.path}: {k.type}{default}")
        lines += ["    " + line for line in textwrap.wrap(k.doc, 92)]
    return "\n".join(lines)


def markdown() -> str:
    """``docs/configuration.md``: one table per section."""
    out = ["# Configuration reference", "",
           "Every key of `topology.toml`, generated from the schema by `python runner.py keys "
           "--markdown > docs/configuration.md` (a test fails when this file is stale). A key is "
           "set in the TOML file or on the command line as a dotted override "
           "(`python runner.py topology.toml learner.lr=2e-5`); `python runner.py keys PREFIX` "
           "prints the same on a terminal. `[]` marks a list of tables (`[[task.datasets]]`), "
           "`[kind=...]` one kind of a list whose entries are told apart by their `kind`.", ""]
    section = None
    for k in keys():
        top = k.path.split(".")[0].split("[")[0]
        if top != section:
            section = top
            out += ["", f"## `{section}`", "", "| key | type | default | what it does |",
                    "|---|---|---|---|"]
        cells = (f"`{k.path}`", k.type, f"`{k.default}`" if k.default else "must be set", k.doc)
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out) + "\n"
