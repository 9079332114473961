"""What a single key may hold, declared on its field (msgspec ``Meta``): decoding refuses a bad
value naming its key path, and ``refusal`` words it as the checks do (``must be >= 1 (got 0)``).
A pattern says what a value failing it is (``extra["bad"]``: ``'gpu' is not auto, cpu, cuda or
cuda:N``); a bound at the largest float (``BIG``) refuses inf and nan. A ``FilePath`` (and a
``ModelPath``) is named relative to where the runner starts: the loader makes every one absolute
(``job/config/load.py``), since the actors run elsewhere.
"""

from __future__ import annotations

import re
import sys
from typing import Annotated, Any

import msgspec
from msgspec import Meta

BIG = sys.float_info.max

PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Finite = Annotated[float, Meta(ge=-BIG, le=BIG)]
PositiveFinite = Annotated[float, Meta(gt=0, le=BIG)]
NonNegFinite = Annotated[float, Meta(ge=0, le=BIG)]
Fraction = Annotated[float, Meta(ge=0, le=1)]  # [0, 1]
Share = Annotated[float, Meta(gt=0, le=1)]  # (0, 1]
Decay = Annotated[float, Meta(ge=0, lt=1)]  # [0, 1): a moving average's factor
Port = Annotated[int, Meta(ge=0, le=65535)]
FilePath = Annotated[str, Meta(extra={"path": True})]
# a model directory, named as a FilePath, or "default": the embedded model (kept as it is)
ModelPath = Annotated[str, Meta(extra={"path": "model"})]


def matching(regex: str, bad: str, shows: str = "") -> Meta:
    """The whole value matches ``regex``; ``bad`` says what a value that does not is, and
    ``shows`` what one that does is, for the key reference (default: ``bad`` without its
    ``is not``: ``is not auto, cpu, ...`` shows as ``auto, cpu, ...``)."""
    return Meta(pattern=rf"\A(?:{regex})\Z", extra={"bad": bad, **({"shows": shows} if shows else {})})


def one_of(names: tuple[str, ...], unset: bool = False) -> Meta:
    """One of ``names`` (or ``""`` with ``unset``), refused listing them."""
    regex = "|".join(map(re.escape, ("",) * unset + names))
    return matching(regex, f"is not one of {', '.join(names)}")


Device = Annotated[str, matching(r"auto|cpu|cuda(:\d+)?", "is not auto, cpu, cuda or cuda:N")]
PythonName = Annotated[str, matching(r"[^\W\d]\w*", "is not a Python name")]
PythonNameOrUnset = Annotated[str, matching(r"(?:[^\W\d]\w*)?", "is not a Python name")]


def refusal(where: str, data: Any, root: type) -> str | None:
    """Why the value at key path ``where`` (``reward.functions[0].weight``) of ``data`` breaks the
    constraint of its field in ``root``; None when that field has none."""
    t: Any = msgspec.inspect.type_info(root)
    value = data
    for name, index in re.findall(r"([^.[\]]+)|\[([^\]]*)\]", where):
        t = _step(t, name, index)
        try:  # the value as given (a table's key is not in the path: [...])
            value = value[name] if name else value[int(index)]
        except (LookupError, TypeError, ValueError):
            value = None
    for member in _members(t):
        extra = (member.extra or {}) if isinstance(member, msgspec.inspect.Metadata) else {}
        c = member.type if isinstance(member, msgspec.inspect.Metadata) else member
        if isinstance(c, msgspec.inspect.StrType) and c.pattern:
            bad = extra.get("bad", f"does not match {c.pattern}")
            return bad if value is None else f"{value!r} {bad}"
        if isinstance(c, msgspec.inspect.IntType | msgspec.inspect.FloatType):
            why = _range(c)
            return why and (why if value is None else f"{why} (got {value!r})")
    return None


def _range(c: Any) -> str | None:
    """The bounds of a number type in words: "must be >= 1", "must be in (0, 1]"."""
    finite = c.le == BIG  # (with ge = -BIG when there is no lower bound: Finite)
    low = (("[", ">=", c.ge) if c.ge not in (None, -BIG)
           else ("(", ">", c.gt) if c.gt is not None else None)
    high = (None if finite else ("]", "<=", c.le) if c.le is not None
            else (")", "<", c.lt) if c.lt is not None else None)
    if low and high:
        return f"must be in {low[0]}{low[2]:g}, {high[2]:g}{high[0]}"
    one = low or high
    if one:
        return f"must be {one[1]} {one[2]:g}{' and finite' if finite else ''}"
    return "must be finite" if finite else None


def _members(t: Any) -> tuple[Any, ...]:
    return t.types if isinstance(t, msgspec.inspect.UnionType) else (t,)


def _step(t: Any, name: str, index: str = "") -> Any:
    """The type one step into ``t``: its field ``name`` (in the first member of a union of
    Structs that has one), or (no name) its items or values (of a fixed tuple, item
    ``index``)."""
    for member in _members(t):
        member = member.type if isinstance(member, msgspec.inspect.Metadata) else member
        field = name and isinstance(member, msgspec.inspect.StructType) and next(
            (f.type for f in member.fields if f.encode_name == name), None)
        if field:
            return field
        if not name and isinstance(member, msgspec.inspect.DictType):
            return member.value_type
        if not name and hasattr(member, "item_type"):
            return member.item_type
        if not name and isinstance(member, msgspec.inspect.TupleType) and index.isdigit() \
                and int(index) < len(member.item_types):
            return member.item_types[int(index)]
    return None
