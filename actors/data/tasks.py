"""Built-in tasks: deterministic prompt generators whose answers a rule scorer checks.

A task is named in ``topology.toml`` (``task.name``), or mixed with dataset files
(``[[task.datasets]]``, ``actors/data/datasets.py``). Its prompts carry ``data_source`` so the
reward worker finds the matching scorer (``actors/scoring/rules.py``, verl's
``compute_score(data_source, solution_str, ground_truth, extra_info)`` signature).
"""

from __future__ import annotations

import random
from typing import Any

from actors.runtime.config import TaskConfig
from messages.rollout import ChatMessage, Prompt


class Task:
    """A dataset of ``size`` prompts, row ``i`` always the same for a given seed.

    Prompts are drawn in order: draw ``index`` takes row ``row`` of dataset ``dataset``
    (``locate``). A single task is its own one dataset, so ``row == index``; a mixture of
    datasets (``actors/data/datasets.py``) spreads the draws over its datasets by weight. The replay
    buffer records ``(prompt_id, row, dataset)`` of every prompt it issues; ``prompt_at`` rebuilds
    a recorded prompt and ``index_after`` turns recorded positions back into the next draw.
    """

    name = ""  # the dataset's name in the recording (and the scorer's data_source by default)
    system_prompt = ""

    def __init__(self, config: TaskConfig, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.size = config.size
        self.data_source = self.name  # which scorer checks the answers, even if renamed
        if config.system_prompt:
            self.system_prompt = config.system_prompt

    def row(self, index: int) -> tuple[str, str, dict[str, Any]]:
        """(user message, ground truth, extra info) of dataset row ``index``."""
        raise NotImplementedError

    def prompt(self, index: int, prompt_id: int) -> Prompt:
        """The prompt of draw ``index``, issued as ``prompt_id``."""
        return self.prompt_at(*self.locate(index), prompt_id=prompt_id)

    def locate(self, index: int) -> tuple[str, int]:
        """``(dataset, row)`` that draw ``index`` takes (rows count up from 0 per dataset, past
        the dataset's size: the row of a later pass is ``row % size``)."""
        return self.name, index

    def prompt_at(self, dataset: str, row: int, prompt_id: int) -> Prompt:
        """The prompt of ``row`` of ``dataset`` (as recorded), issued as ``prompt_id``."""
        if dataset != self.name:
            raise ValueError(f"task {self.name!r} has no dataset {dataset!r}")
        user, truth, extra = self.row(row % self.size)
        messages = [ChatMessage("user", user)]
        if self.system_prompt:
            messages.insert(0, ChatMessage("system", self.system_prompt))
        return Prompt(prompt_id=prompt_id, messages=messages, data_source=self.data_source,
                      ground_truth=truth, extra_info={"index": row % self.size, **extra})

    def index_after(self, next_rows: dict[str, int]) -> int:
        """The first draw after the draws that took rows ``< next_rows[dataset]`` of each
        dataset (what resume sets ``ReplayState.next_row`` to from the recorded prompts)."""
        unknown = set(next_rows) - {self.name}
        if unknown:
            raise ValueError(f"task {self.name!r} has no dataset {sorted(unknown)}")
        return next_rows.get(self.name, 0)


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


class RepeatLetter(Task):
    """``say X``: the reply should consist of the letter X. A tiny random model learns it in seconds."""

    name = "repeat_letter"
    letters = "ab"

    def row(self, index: int) -> tuple[str, str, dict[str, Any]]:
        letter = self.letters[random.Random(self.seed * 7_919 + index).randrange(len(self.letters))]
        return f"say {letter}", letter, {}


class Calculator(Task):
    """Multi-digit arithmetic that a small model cannot do in its head, for the calculator tool.

    Row ``i`` is one of ``a * b`` (a 3-4 digit number times a 2-3 digit one), ``a + b + c``
    (4-5 digit numbers) or ``a * b - c``, scored on the number in the model's last turn
    (``actors/scoring/rules.py``, ``calculator``). Pair it with ``[[agent.tools]] builtin =
    "calculator"``; without the tool it measures how often the model gets it right alone.
    """

    name = "calculator"
    system_prompt = ("You can use a calculator tool. Use it to compute the answer, then reply "
                     "with the final result as a number.")

    def row(self, index: int) -> tuple[str, str, dict[str, Any]]:
        rng = random.Random(self.seed * 1_000_033 + index)
        form = rng.randrange(3)
        if form == 0:
            a, b = rng.randint(100, 9999), rng.randint(12, 999)
            expression, value = f"{a} * {b}", a * b
        elif form == 1:
            a, b, c = (rng.randint(1000, 99999) for _ in range(3))
            expression, value = f"{a} + {b} + {c}", a + b + c
        else:
            a, b, c = rng.randint(100, 999), rng.randint(12, 99), rng.randint(100, 9999)
            expression, value = f"{a} * {b} - {c}", a * b - c
        return f"What is {expression}?", str(value), {"expression": expression}


TASKS: dict[str, type[Task]] = {"arithmetic": Arithmetic, "repeat_letter": RepeatLetter,
                                 "calculator": Calculator}
