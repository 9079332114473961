"""Every kind of actor, in one table: what runs it, how many there may be, how it is started.

The runner starts the kinds in this order (the replay buffer and the router bind the sockets
the others connect to; the learner publishes the first weights the samplers wait for), the
config check enforces the counts, ``python -m actors.main`` calls ``load`` for the actor's body
(imported then, so the router and the replay buffer never import torch) and ``runner.py attach``
accepts the attachable kinds; the runner (``actors/job/processes.py``) applies each row's lifecycle
(gang, ends the job, attached; the restart policy is the kind's config section's). Adding an
actor kind is one row here plus its config section.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from actors.runtime.actor import Body


def _replay() -> Body:  # each imports its actor's module, in the actor's own process only
    from actors.replay.actor import replay_actor

    return replay_actor


def _router() -> Body:
    from actors.router.actor import router_actor

    return router_actor


def _learner() -> Body:
    from actors.learner.actor import learner_actor

    return learner_actor


def _reward() -> Body:
    from actors.reward import reward_actor

    return reward_actor


def _teacher() -> Body:
    from actors.teacher.worker import teacher_actor

    return teacher_actor


def _sampler() -> Body:
    from actors.sampler.actor import sampler_actor

    return sampler_actor


@dataclass(frozen=True)
class ActorKind:
    name: str
    """The kind's name: its ``topology.toml`` section and its processes' ``NAME-INDEX``."""
    load: Callable[[], Body]
    """The actor body (its module imported when called, only in the actor's own process)."""
    min_count: int
    """Fewest processes a job may start (0: the job runs without one, e.g. rewards attached)."""
    max_count: int | None
    """Most processes (1: the kind owns state no second process may share)."""
    attachable: bool = False
    """``runner.py attach KIND`` can add one to a running job."""
    by_address: Literal["router", "runner"] = "router"
    """What ``runner.py attach KIND --to ADDRESS`` names: the router's worker address (a worker
    behind the router, configured by its defaults and overrides) or the address of the job's
    runner (``control_address``), which sends the job's topology to the attaching process."""
    gang: bool = False
    """Its processes live and die together (a learner's ranks: the others of a dead one could
    only hang in a collective, so they are killed and the job stops)."""
    ends_job: bool = False
    """Its finishing ends the job (after the final validation, when one is due)."""


KINDS: tuple[ActorKind, ...] = (
    ActorKind("replay", _replay, 1, 1),
    ActorKind("router", _router, 1, 1),
    ActorKind("learner", _learner, 1, 1, gang=True, ends_job=True),
    ActorKind("reward", _reward, 0, None, attachable=True),
    ActorKind("teacher", _teacher, 0, None, attachable=True),
    ActorKind("sampler", _sampler, 1, None, attachable=True, by_address="runner"),
)
BY_NAME: dict[str, ActorKind] = {k.name: k for k in KINDS}
NAMES: tuple[str, ...] = tuple(k.name for k in KINDS)
ATTACHABLE: tuple[str, ...] = tuple(k.name for k in KINDS if k.attachable)
