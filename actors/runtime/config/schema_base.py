"""The base of every ``topology.toml`` section: unknown keys rejected, frozen, keyword-only;
and the keys every actor kind's section has."""

from __future__ import annotations

from typing import Literal

import msgspec

from actors.runtime.config.constraints import NonNegInt, PositiveInt

Restart = Literal["never", "on-failure"]  # what the runner does when a process of a kind dies


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    pass


class ActorCommon(_Section, frozen=True):
    count: NonNegInt = 1
    """How many processes of this actor kind to start."""
    threads: PositiveInt = 1
    """torch intra-op threads for this actor's compute (its share of the cores)."""
    restart: Restart = "never"
    """What the runner does when one of these processes dies: stop the job, or restart it
    (the stateless kinds' sections default to on-failure)."""
    max_restarts: NonNegInt = 3
    """Restarts allowed per process before the job is stopped."""
    host: str | list[str] = ""
    """With ``[hosts]``: the host these processes run on, or one host per process (a list of
    ``count`` names); empty: the replay buffer's host (the replay buffer's: the first host).
    Under Ray (``run.launcher = "ray"``): a custom resource of the Ray nodes that may run them
    (each process asks for a sliver of it); empty: any node with room."""


class ConfigError(ValueError):
    """A topology that cannot be used; the message names the offending key path."""


def need(ok: bool, key: str, why: str) -> None:
    """The one form of a check the types alone cannot make: raise ``ConfigError("key: why")``
    unless ``ok``. ``key``: the full key path of the value at fault, or, in a section's
    ``__post_init__``, its key within the section (decoding puts the section's path before it)."""
    if not ok:
        raise ConfigError(f"{key}: {why}")


def need_child_memory(memory_mb: int) -> None:
    """A sandboxed child's ``memory_mb`` (reward functions', tools'): 0 or enough for Python."""
    need(memory_mb == 0 or memory_mb >= 128, "memory_mb",
         "must be >= 128 (a Python child needs that much address space) or 0 (no limit)")


def never_restarted(restart: str) -> None:
    """The replay buffer's and the learner's ``restart``: the two stateful actors resume
    together or not at all (the replay buffer rebuilds itself as of the learner's checkpoint,
    which only holds when both start from it)."""
    need(restart == "never", "restart",
         "must be \"never\": restarted alone it would not match the other's state; when it "
         "dies the job stops, and starting it again with the same run.dir resumes exactly")
