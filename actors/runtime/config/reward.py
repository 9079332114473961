"""``[reward]``: the reward functions, their workers and limits."""

from __future__ import annotations

from typing import Annotated

from actors.runtime.config.constraints import (
    FilePath,
    Finite,
    Fraction,
    NonNegFloat,
    NonNegInt,
    PositiveFloat,
    PositiveInt,
    PythonName,
    one_of,
)
from actors.runtime.config.pools import JudgeConfig, RewardModelConfig, check_models
from actors.runtime.config.schema_base import (
    ActorCommon,
    ConfigError,
    Restart,
    _Section,
    need,
    need_child_memory,
)

BUILTIN_SCORERS = ("gsm8k", "math", "exact_match", "answer_tag", "arithmetic", "repeat_letter",
                   "calculator", "reasoning_gym", "verifiers")  # the rules of actors/scoring/rules.py (BUILTINS), by name


class RewardFunction(_Section, frozen=True):
    builtin: Annotated[str, one_of(BUILTIN_SCORERS, unset=True)] = ""
    """A built-in rule (gsm8k, math, exact_match, answer_tag, arithmetic, repeat_letter,
    calculator, reasoning_gym: the generator's own scorer, verifiers: the environment's rubric);
    set this or ``path``."""
    path: FilePath = ""
    """A Python file (relative to where the runner is started) holding a verl-style scoring
    function, which runs in a child process."""
    name: PythonName = "compute_score"
    """The function in ``path``: ``(data_source, solution_str, ground_truth, extra_info)`` ->
    float or dict(score=..., **numeric extras); ``async def`` works too."""
    weight: Finite = 1.0
    """This function's weight in the item's reward (the weighted sum over functions)."""
    batch: bool = False
    """``path`` function takes lists (``data_sources, solution_strs, ground_truths,
    extra_infos``) for a whole request and returns a list."""
    kwargs: dict[str, str | int | float | bool] = {}
    """Extra keyword arguments for every call (gsm8k: method, format_score; answer_tag:
    format_score)."""

    def __post_init__(self) -> None:
        if bool(self.builtin) == bool(self.path):
            raise ConfigError("set either builtin or path (one of them)")
        need(not (self.builtin and self.batch), "batch", "built-ins score one item per call")


class RewardConfig(ActorCommon, frozen=True):
    capacity: PositiveInt = 4
    """Requests one reward worker takes at once."""
    restart: Restart = "on-failure"
    """Reward workers are stateless, so they restart by default."""
    functions: list[RewardFunction] = []
    """Scoring functions, combined by weight (``[[reward.functions]]``). None: each item is
    scored by the built-in its ``data_source`` names (the task's scorer, verl's defaults)."""
    timeout_s: PositiveFloat = 15.0
    """Per call of a function in a child: past it the child is killed, the item scores 0.0."""
    memory_mb: NonNegInt = 2048
    """Address-space limit (RLIMIT_AS) of each scoring child in MiB (0: none)."""
    cpu_s: NonNegInt = 60
    """CPU seconds one call may use in its child (RLIMIT_CPU, re-armed per call; 0: none)."""
    processes: PositiveInt = 4
    """Scoring child processes per worker (calls run in parallel up to this)."""
    overlong_buffer_len: NonNegInt = 0
    """DAPO overlong penalty: tokens before max_response_length where it starts (0: off)."""
    overlong_penalty_factor: NonNegFloat = 1.0
    """DAPO overlong penalty at max_response_length (it falls linearly from 0 to -factor)."""
    max_response_length: NonNegInt = 0
    """L_max of the overlong penalty (0: sampler.max_tokens)."""
    max_error_share: Fraction = 0.5
    """The job stops when scoring failed (an exception, a bad value, a timeout, a crash) on more
    than this share of a step's samples, or of a validation round's; below it the failures are
    counted (``replay/score_errors``) and shown. 0.5: a systematic bug stops the first step, one
    flaky item in 100 never does (1.0: never stop)."""
    models: list[RewardModelConfig | JudgeConfig] = []
    """Served models (``[[reward.models]]``, by ``kind``: reward models and LLM judges), each a
    pool of its own replicas behind the router; every group is scored by each, weighted
    (config/pools.py)."""
    rules: bool = True
    """Score with the rule workers (``functions``, or the data source's built-in) too; false:
    only the served models score (then no overlong penalty, which the rule workers add)."""

    def __post_init__(self) -> None:
        need_child_memory(self.memory_mb)
        check_models(self.models)
        need(self.rules or bool(self.models), "rules",
             "false needs at least one [[reward.models]] to score with")
