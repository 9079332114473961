"""The prompt source a topology names: one built-in task, or a weighted mixture of datasets."""

from __future__ import annotations

from actors.data.datasets import make_mixture
from actors.data.tasks import TASKS, Task
from actors.runtime.config import TaskConfig


def make_task(config: TaskConfig, seed: int) -> Task:
    """The built-in ``config.name``, or the mixture of ``config.datasets`` when any are set."""
    if config.datasets:
        return make_mixture(config, seed)
    try:
        return TASKS[config.name](config, seed)
    except KeyError:
        raise ValueError(f"task.name = {config.name!r} is not a built-in task; "
                         f"choose one of {sorted(TASKS)}") from None
