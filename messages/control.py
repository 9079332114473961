"""Control flow between every actor and the runner (lifecycle, heartbeats, stop).

Sockets: the runner binds a ROUTER (``control`` address); every actor connects a DEALER whose
identity is its actor name (``sampler-0``).
"""

from __future__ import annotations

import msgspec

# status values are plain scalars (or one level of them by name: the router's per-worker
# figures) so any actor can report anything without a schema change
Scalar = int | float | str | bool | None
StatusValue = Scalar | dict[str, Scalar]


class Ready(msgspec.Struct, tag=True):
    """Actor -> Runner: sockets are bound/connected and the actor is serving."""

    actor: str
    pid: int
    status: dict[str, StatusValue] = {}  # its status as it starts serving (a heartbeat may not
    # come before a short-lived actor is done)


class Heartbeat(msgspec.Struct, tag=True, gc=False):
    """Actor -> Runner, every ``heartbeat_interval`` seconds: liveness plus a status snapshot."""

    actor: str
    status: dict[str, StatusValue] = {}


class ImageSample(msgspec.Struct, gc=False):
    """One sample of a step's batch whose prompt had images, as the trackers show it."""

    images: list[bytes]  # the prompt's images, encoded (PNG, JPEG, ...) as the dataset had them
    answer: str  # the sampled response, decoded
    reward: float
    prompt_id: int


class StepReport(msgspec.Struct, tag=True, gc=False):
    """Learner -> Runner after every optimizer step: the metrics of that step (verl names)."""

    step: int
    metrics: dict[str, float] = {}
    samples: list[ImageSample] = []  # every run.image_interval steps: a few samples with images


class ValidationReport(msgspec.Struct, tag=True, gc=False):
    """Replay -> Runner when a validation is complete: its metrics (verl names,
    ``val-core/{data_source}/reward/mean@N``, ...) for the policy after ``step`` learner steps."""

    step: int
    metrics: dict[str, float] = {}


class Finished(msgspec.Struct, tag=True):
    """Actor -> Runner: the actor's work is complete (the learner reached ``total_steps``)."""

    actor: str
    detail: str = ""
    status: dict[str, StatusValue] = {}  # its last status


class Stop(msgspec.Struct, tag=True):
    """Runner -> Actor: cancel everything and exit (the learner writes its final checkpoint)."""

    reason: str = ""


class ErrorReply(msgspec.Struct, tag=True):
    """Any -> sender of a frame that did not decode (or a request that cannot be served)."""

    error: str


class Abort(msgspec.Struct, tag=True):
    """Actor -> Runner: the job cannot go on (scoring fails past ``reward.max_error_share``):
    stop every actor; the job fails, ``reason`` (its first line is the outcome) is shown."""

    actor: str
    reason: str


class AskTopology(msgspec.Struct, tag=True):
    """Attacher -> Runner (``runner.py attach KIND --to tcp://RUNNER``): the job's resolved
    topology, so a worker on another machine joins with the job's own addresses and settings."""


class JobTopology(msgspec.Struct, tag=True):
    """Runner -> Attacher: ``topology.json`` as the runner wrote it."""

    topology: bytes


ToRunner = (Ready | Heartbeat | StepReport | Finished | ErrorReply | ValidationReport | Abort
            | AskTopology)
ToAttacher = JobTopology | ErrorReply
ToActor = Stop | ErrorReply
