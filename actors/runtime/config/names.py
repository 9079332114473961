"""A process's name in a job, as a typed value: its kind, its index among that kind and, for a
learner, its rank.

Every process the runner places and starts is named ``KIND-INDEX`` (``sampler-1``,
``reward-0``, ``teacher-2``); a learner's rank 0 is ``learner-0`` (it speaks for the group) and
its other ranks ``learner-0.rankR``. The string is what logs, statuses, placements and the live
panel show; code that needs a part reads it from ``ProcessName.parse`` rather than cutting the
string itself. A worker attached by hand keeps the name it was given, which need not parse.

Torch-free: the runner imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ProcessName:
    """The parts of a process's name; ``str()`` gives the name itself. Ordered by kind, index,
    then rank."""

    kind: str
    """The actor kind (a row of ``actors/registry.py``: ``learner``, ``sampler``, ...)."""
    index: int = 0
    """Which process of its kind, from 0 (a served model's replicas follow the rule workers)."""
    rank: int = 0
    """The learner's rank (0 for every other kind, and for the rank that speaks for a group)."""

    def __str__(self) -> str:
        base = f"{self.kind}-{self.index}"
        return base if self.rank == 0 else f"{base}.rank{self.rank}"

    @classmethod
    def parse(cls, name: str) -> ProcessName:
        """The parts of ``name`` (``KIND-INDEX`` or ``KIND-INDEX.rankR``); ValueError when it
        is not one (an attached worker's own name)."""
        head, dot, rank = name.partition(".rank")
        kind, dash, index = head.partition("-")
        if not (kind and dash and index.isdigit() and (not dot or rank.isdigit())):
            raise ValueError(f"not a process name (KIND-INDEX or KIND-INDEX.rankR): {name!r}")
        return cls(kind, int(index), int(rank) if dot else 0)


def of_kind(kind: str, names: Iterable[str]) -> list[ProcessName]:
    """The processes of ``kind`` among ``names``, in their order (other names are passed over,
    and so is a name that is not a process name, as a worker attached by hand may have:
    ``sampler-attached-PID``)."""
    out = []
    for name in names:
        try:
            parts = ProcessName.parse(name)
        except ValueError:  # an attached worker's own name
            continue
        if parts.kind == kind:
            out.append(parts)
    return out
