"""The validation prompt set of a topology: every prompt of every ``[[validation.datasets]]``.

A dataset contributes its first ``size`` rows in its own order (a file's seeded order when it
is shuffled; 0: all its rows; a built-in task: 64 when not given). Built-in tasks are drawn
with seed ``run.seed + 1``, so their rows are not the training draws (which take seed
``run.seed``; a task with few distinct prompts, like single-digit arithmetic, repeats them
anyway). Prompt ids count 0, 1, ... over the set: they name a prompt within a validation round,
apart from the training prompts' ids.
"""

from __future__ import annotations

import msgspec

from actors.data.datasets import FileDataset
from actors.data.tasks import TASKS, Task
from actors.runtime.config import Topology
from messages.rollout import Prompt, SamplingParams

BUILTIN_SIZE = 64  # prompts of a built-in validation task without a size


def validation_prompts(topology: Topology) -> list[Prompt]:
    """The validation prompts, dataset after dataset (empty: no validation)."""
    out: list[Prompt] = []
    seed = topology.run.seed
    for i, d in enumerate(topology.validation.datasets):
        task: Task
        if d.builtin:
            size = d.size or BUILTIN_SIZE
            config = msgspec.structs.replace(topology.task, size=size)
            task = TASKS[d.builtin](config, seed + 1)
            task.name = d.label
        elif d.reasoning_gym is not None:  # seed + 1: rows apart from the training draws
            from actors.data.reasoning_gym import ReasoningGymTask

            task = ReasoningGymTask(d.reasoning_gym, seed + 1, d.label,
                                    f"validation.datasets[{i}]", d.system_prompt)
            size = min(d.size or BUILTIN_SIZE, task.size)
        elif d.verifiers is not None:  # held out by its args (an eval split)
            from actors.data.verifiers_env import VerifiersTask

            task = VerifiersTask(d, seed, f"validation.datasets[{i}]")
            size = min(d.size, task.size) if d.size else task.size
        else:
            task = FileDataset(d, seed, f"validation.datasets[{i}]")
            size = min(d.size, task.size) if d.size else task.size
        for row in range(size):
            out.append(task.prompt_at(task.name, row, prompt_id=len(out)))
    return out


def validation_sampling(topology: Topology) -> SamplingParams:
    """How validation samples (``validation.*``, defaulted to the sampler's by the config)."""
    V, s = topology.validation, topology.sampler
    return SamplingParams(temperature=V.temperature if V.temperature is not None else s.temperature,
                          top_p=V.top_p if V.top_p is not None else s.top_p,
                          top_k=s.top_k,
                          max_tokens=V.max_tokens if V.max_tokens is not None else s.max_tokens,
                          stop=tuple(s.stop))


def validates(topology: Topology) -> bool:
    """Whether the job validates at all."""
    V = topology.validation
    return bool(V.datasets) and (V.every > 0 or V.before_training)
