"""``[run]``: the run directory, ports, status and logging, and what a run does once it ends."""

from __future__ import annotations

from typing import Literal

from actors.runtime.config.constraints import (
    NonNegFinite,
    NonNegInt,
    PositiveFinite,
    PositiveFloat,
    PositiveInt,
)
from actors.runtime.config.schema_base import _Section, need


class RunConfig(_Section, frozen=True):
    dir: str = "runs/{time}"
    """Run directory (metrics.jsonl, checkpoints, logs). ``{time}`` becomes a timestamp."""
    seed: NonNegInt = 0
    """Seed for dataset order, sampling and initialisation."""
    status_interval: NonNegFinite = 15.0
    """Seconds between the runner's ``status`` records in status.jsonl (every actor's last
    status; 0: none besides the per-step ones)."""
    heartbeat_interval: PositiveFinite = 2.0
    """Seconds between actor heartbeats to the runner."""
    heartbeat_timeout: PositiveFinite = 120.0
    """An actor silent for this long is treated as dead."""
    socket_dir: str = ""
    """Directory for ipc:// sockets of ``auto`` addresses (default: a fresh folder under /tmp)."""
    record: bool = True
    """Record prompts, groups, fates, batches and metrics to RUN_DIR/record (crash resume needs it)."""
    host: str = ""
    """With ``[hosts]``: the host this runner starts the actors of (``runner.py ... --host NAME``)."""
    base_port: PositiveInt = 27100
    """With ``[hosts]``: ``auto`` addresses become ``tcp://HOST:base_port+k`` (k fixed per socket,
    runner control ports base_port+10+i for the i-th host), the same on every host. Below
    Linux's ephemeral range (32768-60999 by default), so no outgoing connection on a host can
    hold one of the job's ports before its actor binds it."""
    host_wait_s: PositiveFloat = 300.0
    """With ``[hosts]``: how long a runner waits for the actors (or runner) of other hosts."""
    loggers: tuple[Literal["console", "jsonl", "tensorboard", "wandb", "mlflow"], ...] = (
        "console", "jsonl")
    """Where every metric of every step and of every validation goes (verl ``trainer.logger``):
    ``console`` (a live panel on a terminal, one line per step otherwise), ``jsonl``
    (RUN_DIR/metrics.jsonl and validation.jsonl), ``tensorboard`` (RUN_DIR/tensorboard),
    ``wandb`` (WANDB_* variables apply; ``WANDB_MODE=offline`` needs no network), ``mlflow``
    (MLFLOW_TRACKING_URI, default a file store in RUN_DIR/mlruns)."""
    image_samples: NonNegInt = 4
    """A vision-language model: how many of a step's samples (one per prompt, prompts with
    images) tensorboard and wandb show as images with their answers and rewards (0: none)."""
    image_interval: PositiveInt = 10
    """Steps between two such sets of images (the first at this step)."""
    project_name: str = "flowrl"
    """The wandb project and the mlflow experiment (verl ``trainer.project_name``)."""
    experiment_name: str = ""
    """The tracker run's name (verl ``trainer.experiment_name``; default: the run directory's)."""
    launcher: Literal["local", "ray"] = "local"
    """What starts the actor processes (a row of ``actors/job/launchers/table.py``): this runner
    (``local``: on this machine, or on this host of ``[hosts]``), or Ray (``ray``: the runner
    is a Ray driver that reserves the job's resources and starts each process on its node;
    ``[ray]`` says which cluster; ``runner.py topology.toml --ray [ADDRESS]`` sets both)."""

    deterministic: bool = False
    """A fixed schedule (actors/replay/schedule.py): two runs of one topology and seed on one
    machine record the same groups and metrics bit for bit, across restarts and resumes too;
    step k's groups are one batch generated with version max(0, k - 1 - max_staleness)."""

    def __post_init__(self) -> None:
        need(len(set(self.loggers)) == len(self.loggers), "loggers", "names a logger twice")
