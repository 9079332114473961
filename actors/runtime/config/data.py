"""``[task]`` and ``[validation]``: the prompts a job trains and validates on (built-in tasks,
verl-layout files, generators and environments)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from actors.runtime.config.constraints import (
    FilePath,
    Finite,
    NonNegFloat,
    NonNegInt,
    PositiveFinite,
    PositiveInt,
    Share,
    matching,
    one_of,
)
from actors.runtime.config.schema_base import ConfigError, _Section, need
from actors.runtime.config.sources import ReasoningGymSource, VerifiersSource

BUILTIN_TASKS = ("arithmetic", "repeat_letter", "calculator")
DatasetPath = Annotated[FilePath, matching(r"(?:.*[^/]\.(?:parquet|jsonl))?",
                                           "is neither .parquet nor .jsonl",
                                           "a .parquet or .jsonl file, or unset")]


class DatasetConfig(_Section, frozen=True):
    path: DatasetPath = ""
    """A parquet or jsonl file of prompts (relative to where the runner is started), in verl's
    row layout: ``prompt`` (list of chat messages), ``data_source``,
    ``reward_model.ground_truth``, ``extra_info``. Set this or ``builtin``."""
    builtin: Annotated[str, one_of(BUILTIN_TASKS, unset=True)] = ""
    """A built-in task instead of a file (``arithmetic``, ``repeat_letter``, ``calculator``;
    task.size, task.max_operand and task.system_prompt apply)."""
    weight: PositiveFinite = 1.0
    """Share of the prompts drawn from this dataset (weights are normalised over the list)."""
    name: str = ""
    """Name in the recording's ``prompts.dataset`` column (default: the file's stem or the
    built-in's name); unique over the list."""
    prompt_key: str = "prompt"
    """Column of the prompt: a list of ``{role, content}`` messages, or a string (one user
    message), e.g. ``question`` (verl ``data.prompt_key``)."""
    answer_key: str = "reward_model.ground_truth"
    """Column of the ground truth, dotted for nested fields (``answer`` for a plain file)."""
    data_source: str = ""
    """The reward scorer's ``data_source`` for every row (default: the row's ``data_source``)."""
    system_prompt: str = ""
    """A system message put before a row's messages when it has none."""
    shuffle: bool = True
    """Visit the rows in a seeded random order, a new one each pass (verl ``data.shuffle``)."""
    image_key: str = ""
    """Column of a row's images, for a vision-language model: a list (or, TRL's ``image``, one)
    of ``{bytes}`` / ``{path}`` records (verl's ``images`` as its geometry3k preprocessing
    writes them) or paths, relative to the data file's folder. Default: ``images``, else
    ``image``, when the file has such a column; ``<image>`` in the prompt's text marks where
    each goes (none: all before the first user message's text, as TRL puts them)."""

    reasoning_gym: ReasoningGymSource | None = None
    """A reasoning-gym generator instead of a file (``reasoning_gym = { name = "leg_counting" }``):
    its questions as user messages, its own scorer as the reward (data_source
    ``reasoning_gym/NAME``)."""

    verifiers: VerifiersSource | None = None
    """A verifiers environment instead of a file (``verifiers = { id = "my_env" }`` or
    ``{ path = "my_env.py", args = { ... } }``): its tasks' prompts, its rubric as the reward
    (data_source ``verifiers/NAME``); a multi-turn one (its ``Env`` plays the turns) needs
    ``agent.env.verifiers``."""

    def __post_init__(self) -> None:
        if sum(map(bool, (self.path, self.builtin, self.reasoning_gym, self.verifiers))) != 1:
            raise ConfigError("set one of path, builtin, reasoning_gym or verifiers")

    @property
    def label(self) -> str:
        """Its name in the recording: ``name``, else the built-in's, the reasoning-gym
        generator's or the file's stem."""
        return (self.name or self.builtin or (self.reasoning_gym and self.reasoning_gym.name)
                or (self.verifiers and (self.verifiers.id or Path(self.verifiers.path).stem))
                or Path(self.path).stem)


def _unique_names(datasets: Sequence[DatasetConfig], where: str) -> None:
    """Each dataset of a list has its own name (``where``: the list's key path)."""
    names: dict[str, int] = {}
    for i, d in enumerate(datasets):
        need(d.label not in names, f"datasets[{i}].name",
             f"{d.label!r} is already the name of {where}[{names.get(d.label)}]; name one")
        names[d.label] = i


class TaskConfig(_Section, frozen=True):
    name: Annotated[str, one_of(BUILTIN_TASKS)] = "arithmetic"
    """Built-in task (``arithmetic``, ``repeat_letter``, ``calculator``: multi-digit arithmetic
    for the calculator tool); not used when ``datasets`` is set."""
    datasets: list[DatasetConfig] = []
    """Prompt sources mixed by weight (``[[task.datasets]]``): the source of the i-th prompt
    drawn is a function of run.seed and i alone, so a run's data order is reproducible."""
    max_prompt_length: NonNegInt = 0
    """Skip prompts longer than this many chat-templated tokens of the model's tokenizer (verl
    ``data.max_prompt_length``; 0: no limit). Skipped prompts are counted, never issued."""
    size: PositiveInt = 100_000
    """Number of distinct prompts the task generates."""
    max_operand: PositiveInt = 9
    """arithmetic: operands are drawn from 1..max_operand."""
    system_prompt: str = ""
    """Override the task's system prompt (empty: the task's own)."""

    def __post_init__(self) -> None:
        _unique_names(self.datasets, "task.datasets")


class ValidationDataset(DatasetConfig, frozen=True):
    size: NonNegInt = 0
    """Prompts taken: the first ``size`` rows in the dataset's order (a file's seeded order with
    ``shuffle``); 0: every row of a file, 64 prompts of a built-in task. ``weight`` is not used:
    every prompt of every validation dataset is validated each time."""


class ValidationConfig(_Section, frozen=True):
    every: NonNegInt = 0
    """Validate every this many learner steps, and after the last one (0: never)."""
    before_training: bool = True
    """Validate the initial policy too (step 0), when ``datasets`` are set."""
    n: PositiveInt = 4
    """Samples per prompt: the N of mean@N, best@N, pass@k (k = 1, 2, 4, ... <= N)."""
    temperature: NonNegFloat | None = None
    """Sampling temperature of validation (default: sampler.temperature)."""
    top_p: Share | None = None
    """Nucleus mass of validation (default: sampler.top_p)."""
    max_tokens: PositiveInt | None = None
    """Response budget of validation (default: sampler.max_tokens)."""
    pass_threshold: Finite = 1.0
    """A sample counts as correct for pass@k when its score is at least this."""
    datasets: list[ValidationDataset] = []
    """Validation prompts (``[[validation.datasets]]``), in the forms of ``task.datasets``: files
    in verl's layout or built-in tasks. Each prompt's ``data_source`` names its metrics:
    ``val-core/{data_source}/reward/mean@N``. Empty: no validation."""

    def __post_init__(self) -> None:
        _unique_names(self.datasets, "validation.datasets")
