"""A small verifiers (0.4.0) environment for tests/test_verifiers.py: sums of two digits, made in
memory (no dataset or model download), built with verifiers' own classes the way an environment
package is: a ``Taskset`` exported in ``__all__``, its ``TasksetConfig`` taking the args, a
``Task`` whose two ``@vf.reward`` functions are the rubric (``correct`` weighs 1, ``formatted``
0.25) and a ``@vf.metric`` (recorded by verifiers, not summed).

Args: ``size`` tasks; ``split`` ``train`` or ``test`` (other numbers: the held-out set);
``few_shot``, a worked example as user/assistant turns before the question; ``raise_on``,
``correct`` raises on the tasks whose first operand is this digit (a reward that fails at run
time on about one task in ten).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

SYSTEM_PROMPT = "Add the numbers. Give the sum in <answer></answer> tags."
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class AdditionConfig(vf.TasksetConfig):
    size: int = 64
    split: str = "train"
    few_shot: bool = False
    raise_on: int = -1


class AdditionData(vf.TaskData):
    answer: str = ""
    raise_on: int = -1
    first: int = 0


class AdditionTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.first == self.data.raise_on:
            raise RuntimeError(f"no sums starting with {self.data.raise_on} (task {self.data.idx})")
        found = ANSWER.findall(trace.last_reply)
        return float(bool(found) and found[-1].strip() == self.data.answer)

    @vf.reward(weight=0.25)
    async def formatted(self, trace: vf.Trace) -> float:
        return float(len(ANSWER.findall(trace.last_reply)) == 1)

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self) -> Iterator[AdditionTask]:
        rng = random.Random(self.config.split)
        for _ in range(self.config.size):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            question = f"What is {a} + {b}?"
            prompt: str | vf.Messages = question
            if self.config.few_shot:
                prompt = [vf.UserMessage(content="What is 2 + 2?"),
                          vf.AssistantMessage(content="<answer>4</answer>"),
                          vf.UserMessage(content=question)]
            yield AdditionTask(AdditionData(prompt=prompt, system_prompt=SYSTEM_PROMPT,
                                            answer=str(a + b), first=a,
                                            raise_on=self.config.raise_on))


__all__ = ["AdditionTaskset"]
