"""Task sources from environment libraries users already have: one options table per library
(``[[task.datasets]] reasoning_gym = {...}`` or ``verifiers = {...}``), each read by its
prompt source in ``actors/data/`` and scored by its own rules."""

from __future__ import annotations

from typing import Any, Literal

from actors.runtime.config.constraints import FilePath, NonNegInt, PositiveInt
from actors.runtime.config.schema_base import ConfigError, _Section


class ReasoningGymSource(_Section, frozen=True):
    name: str
    """A reasoning-gym generator, as ``reasoning_gym.create_dataset`` names it (``leg_counting``,
    ``basic_arithmetic``, ...: the package lists about 100); its prompts and answers, and its
    own ``score_answer`` as the reward (``pip install 'flowrl[envs]'``)."""
    config: dict[str, Any] = {}
    """The generator's options (its config's fields, e.g. ``{ min_animals = 3 }``)."""
    size: PositiveInt = 10_000
    """Distinct rows the generator makes (row ``i`` is the same for a seed: run.seed in
    training, run.seed + 1 in validation)."""
    answer: Literal["tags", "reply"] = "tags"
    """Where the answer is read: ``tags``, the last ``<answer>`` tag's content under the
    library's own system prompt (reasoning-gym's convention); ``reply``, the whole reply
    stripped, under a system prompt asking for the answer alone (for a model too small to
    write the tags: the generators' ``score_answer`` gives partial credit to a reply that holds
    the answer among other text, so the reward still grows as the reply shrinks to it)."""


class VerifiersSource(_Section, frozen=True):
    id: str = ""
    """An installed verifiers environment (its package name, as ``vf-eval`` takes it; a Hub id
    ``owner/name`` names the package ``name``) exporting its ``Taskset``; set this or ``path``
    (``pip install 'flowrl[verifiers]'``)."""
    path: FilePath = ""
    """A Python file (relative to where the runner is started) exporting a verifiers
    ``Taskset`` subclass in ``__all__``."""
    args: dict[str, Any] = {}
    """The taskset config's fields (e.g. ``{ split = "test" }``), checked by its own config."""
    size: NonNegInt = 0
    """Tasks taken from the start of the taskset (0: all; an infinite taskset needs one)."""

    def __post_init__(self) -> None:
        if bool(self.id) == bool(self.path):
            raise ConfigError("set either id or path (one of them)")
