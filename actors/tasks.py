"""Built-in tasks: a deterministic prompt generator and the rule scorer that checks its answers.

A task is named in ``topology.toml`` (``task.name``). Its prompts carry ``data_source`` so the
reward worker finds the matching scorer; scorers follow verl's
``compute_score(data_source, solution_str, ground_truth, extra_info)`` signature.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from actors.runtime.config import TaskConfig
from messages.rollout import ChatMessage, Prompt

_INT = re.compile(r"-?\d+")


class Task:
    """A dataset of ``size`` prompts, row ``i`` always the same for a given seed."""

    name = ""
    system_prompt = ""

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.size = config.size
        if config.system_prompt:
            self.system_prompt = config.system_prompt

    def row(self, index: int) -> tuple[str, str, dict[str, Any]]:
        """(user message, ground truth, extra info) of dataset row ``index``."""
        raise NotImplementedError

    def prompt(self, index: int, prompt_id: int) -> Prompt:
        user, truth, extra = self.row(index % self.size)
        messages = [ChatMessage("user", user)]
        if self.system_prompt:
            messages.insert(0, ChatMessage("system", self.system_prompt))
        return Prompt(prompt_id=prompt_id, messages=messages, data_source=self.name,
                      ground_truth=truth, extra_info={"index": index % self.size, **extra})


class Arithmetic(Task):
    """``a + b`` with single-digit operands; the reply must state the sum and no wrong number.

    Chosen because the embedded 135M model starts at a measurable reward (about 0.1-0.3 on
    this scorer), so GRPO has signal; answers in ``<answer>`` tags start near 0.
    """

    name = "arithmetic"
    system_prompt = "You are a calculator. Reply with the result."

    def row(self, index: int) -> tuple[str, str, dict[str, Any]]:
        rng = random.Random(self.seed * 1_000_003 + index)
        a = rng.randint(1, self.config.max_operand)
        b = rng.randint(1, self.config.max_operand)
        return f"{a} + {b}", str(a + b), {"a": a, "b": b}


def arithmetic_score(data_source: str, solution_str: str, ground_truth: str,
                     extra_info: dict[str, Any] | None = None) -> float:
    """1.0 when the sum appears and every number in the reply is an operand or the sum."""
    numbers = [int(x) for x in _INT.findall(solution_str)]
    allowed = {int(ground_truth)}
    if extra_info:
        allowed |= {int(extra_info[k]) for k in ("a", "b") if k in extra_info}
    return float(int(ground_truth) in numbers and all(x in allowed for x in numbers))


class RepeatLetter(Task):
    """``say X``: the reply should consist of the letter X. A tiny random model learns it in seconds."""

    name = "repeat_letter"
    letters = "ab"

    def row(self, index: int) -> tuple[str, str, dict[str, Any]]:
        letter = self.letters[random.Random(self.seed * 7_919 + index).randrange(len(self.letters))]
        return f"say {letter}", letter, {}


def repeat_letter_score(data_source: str, solution_str: str, ground_truth: str,
                        extra_info: dict[str, Any] | None = None) -> float:
    """Fraction of the reply's non-space characters that are the asked letter."""
    chars = [c for c in solution_str if not c.isspace()]
    return sum(c == ground_truth for c in chars) / len(chars) if chars else 0.0


TASKS: dict[str, type[Task]] = {"arithmetic": Arithmetic, "repeat_letter": RepeatLetter}

Scorer = Callable[[str, str, str, dict[str, Any] | None], float]
SCORERS: dict[str, Scorer] = {"arithmetic": arithmetic_score, "repeat_letter": repeat_letter_score}


def make_task(config: TaskConfig, seed: int) -> Task:
    try:
        return TASKS[config.name](config, seed)
    except KeyError:
        raise ValueError(f"task.name = {config.name!r} is not a built-in task; "
                         f"choose one of {sorted(TASKS)}") from None
