"""An OpenEnv environment for the tests: guess a digit, told higher or lower, in at most three
guesses. Served by openenv's own server (``create_app``): ``app`` below, as
``[agent.env.openenv] app = "tests.openenv_guess:app"`` names it. The digit comes from
``reset(seed=...)`` (7 without one); a guess is the last digit of the action's ``message``
(none: told so, no reward), right ends the episode with reward 1, three guesses end it."""

from __future__ import annotations

import re
from typing import Any

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    message: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session its own object

    def __init__(self) -> None:
        super().__init__()
        self.digit, self._state = 7, State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self.digit = 7 if seed is None else seed % 10
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(message="Guess a digit from 0 to 9.", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None,  # type: ignore[override]
             **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        last = self._state.step_count >= 3
        digits = re.findall(r"\d", action.message)
        if not digits:
            return GuessObservation(message="No digit in your guess.", done=last, reward=0.0)
        guess = int(digits[-1])
        if guess == self.digit:
            return GuessObservation(message="Right.", done=True, reward=1.0)
        return GuessObservation(message="Higher." if guess < self.digit else "Lower.",
                                done=last, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                 max_concurrent_envs=64)
