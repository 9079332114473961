"""A multi-turn verifiers (0.4.0) environment for tests/test_verifiers_turns.py: guess a number
from 1 to 9, the environment answering ``higher`` or ``lower``, made in memory with verifiers'
own classes the way its game environments are (a ``Taskset`` and the ``Env`` that plays it,
both in ``__all__``; ``run`` drives the turns through ``interaction.turn``).

The task's rubric reads the whole conversation: ``solved`` (weight 1) when some reply guessed
the number, ``quick`` (0.5) one over the turns it took, ``formatted`` (0.25) the share of replies
with exactly one ``<guess>`` tag, ``digits`` (0.125) the share of
the replies' characters that are digits, and a
``turns`` metric. ``run`` records a ``first_try`` reward
of its own (0.5). Args: ``size``, ``split``; ``raise_on``, ``run`` raises on the first reply
of the games whose number is this digit; ``reward_raise_on``, ``solved`` raises on them;
``endless``, the game never ends (a right guess is answered ``again``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

SYSTEM_PROMPT = "Guess the number. Reply with one guess in <guess></guess> tags."
GUESS = re.compile(r"<guess>\s*(\d+)\s*</guess>")


def guesses(text: str) -> list[int]:
    return [int(g) for g in GUESS.findall(text)]


class GuessConfig(vf.TasksetConfig):
    size: int = 64
    split: str = "train"
    raise_on: int = -1
    reward_raise_on: int = -1
    endless: bool = False


class GuessData(vf.TaskData):
    secret: int = 0
    raise_on: int = -1
    reward_raise_on: int = -1
    endless: bool = False


def replies(trace: vf.Trace) -> list[str]:
    return [m.content or "" for m in trace.assistant_messages]


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def solved(self, trace: vf.Trace) -> float:
        if self.data.secret == self.data.reward_raise_on:
            raise RuntimeError(f"no scoring of {self.data.secret}s")
        return float(any(self.data.secret in guesses(r)[-1:] for r in replies(trace)))

    @vf.reward(weight=0.5)
    async def quick(self, trace: vf.Trace) -> float:
        said = replies(trace)
        hit = [k for k, r in enumerate(said) if self.data.secret in guesses(r)[-1:]]
        return 1.0 / (hit[0] + 1) if hit else 0.0

    @vf.reward(weight=0.25)
    async def formatted(self, trace: vf.Trace) -> float:
        said = replies(trace)
        return sum(len(guesses(r)) == 1 for r in said) / len(said) if said else 0.0

    @vf.reward(weight=0.125)
    async def digits(self, trace: vf.Trace) -> float:
        said = "".join(replies(trace))
        return sum(c.isdigit() for c in said) / len(said) if said else 0.0

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        data = task.data
        async with agents.player.interaction(task) as game:
            segment = await game.turn()
            first = True
            while not segment.terminated:
                if first and data.secret == data.raise_on:
                    raise RuntimeError(f"the game of {data.secret} broke")
                said = guesses(segment.last_reply)
                if first:
                    game.trace.record_reward("first_try", float(said[-1:] == [data.secret]), 0.5)
                    first = False
                if not said:
                    hint = "No guess found: reply <guess>N</guess>."
                elif said[-1] == data.secret:
                    if not data.endless:
                        break
                    hint = "again"
                else:
                    hint = "higher" if said[-1] < data.secret else "lower"
                segment = await game.turn(hint)


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self) -> Iterator[GuessTask]:
        rng = random.Random(self.config.split)
        for i in range(self.config.size):
            secret = rng.randint(1, 9)
            yield GuessTask(GuessData(
                prompt=f"Game {i}: I picked a number from 1 to 9. Guess it.", system_prompt=SYSTEM_PROMPT,
                secret=secret, raise_on=self.config.raise_on,
                reward_raise_on=self.config.reward_raise_on, endless=self.config.endless))


__all__ = ["GuessEnv", "GuessTaskset"]
