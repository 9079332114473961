"""The environment half of an OpenEnv source: a session with an OpenEnv server as flowrl's
reset/step environment, one object per episode in a sandboxed child (``[agent.env.openenv]``;
``actors/sampler/agent/env.py`` hosts it, and serves the server itself when ``app`` names it).

OpenEnv's client speaks to the server over a websocket, one session each, with typed actions
and observations that are JSON objects on the wire. Its generic client takes and gives plain
dicts, so no environment's own package is needed here: the model's turn becomes the action
``{action_key: text}``, and the observation becomes the text the model reads next (its
``observation_key`` field, or its only text field, or all its fields as JSON). The step's
reward and done are the server's; a reward the server leaves unset (None) counts 0.

A server that refuses an action (a validation error: the action's field is not
``action_key``) answers with an error, which the step raises: the model reads it and the
episode goes on, counted in ``env_errors``. A server that does not answer within
``agent.tool_timeout_s`` gets the step killed with its child, as any environment's.
"""

from __future__ import annotations

import json
from typing import Any

INSTALL = "pip install 'flowrl[openenv]' (openenv-core==0.3.0)"
RESET_KWARGS = "reset_kwargs"  # a prompt's own reset arguments, in its extra_info


def observation_text(observation: dict[str, Any], key: str = "") -> str:
    """What the model reads of ``observation`` (the server's observation fields, without its
    reward, done and metadata): field ``key``; or, with no key, its only field when that is
    text; else every field, as JSON."""
    if key:
        if key not in observation:
            raise KeyError(f"the observation has no field {key!r} (agent.env.openenv."
                           f"observation_key; its fields: {', '.join(sorted(observation))})")
        value = observation[key]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    if len(observation) == 1:
        (value,) = observation.values()
        if isinstance(value, str):
            return value
    return json.dumps(observation, sort_keys=True)


class OpenEnvEpisode:
    """One episode: a session of its own with the server at ``url``."""

    def __init__(self, url: str, action_key: str, observation_key: str,
                 reset_kwargs: dict[str, Any], timeout_s: float) -> None:
        try:
            from openenv.core.generic_client import GenericEnvClient
        except ImportError as exc:
            raise ImportError(f"openenv-core is not installed: {INSTALL} ({exc})") from exc
        self.action_key, self.observation_key = action_key, observation_key
        self.reset_kwargs = reset_kwargs
        self.client = GenericEnvClient(base_url=url, connect_timeout_s=timeout_s,
                                       message_timeout_s=timeout_s).sync()

    def reset(self, prompt: dict[str, Any]) -> str:
        """The server's first observation (the prompt is the dataset's: the model reads it
        before this). The reset's arguments are ``reset_kwargs`` updated by the prompt's own
        (``extra_info["reset_kwargs"]``, a table in the dataset's row): a row that names its
        seed or puzzle gives every sample of its group the same one, as GRPO's group baseline
        assumes."""
        own = prompt.get("extra_info", {}).get(RESET_KWARGS, {})
        if isinstance(own, str):  # a nested value travels as JSON text (``datasets.py``)
            own = json.loads(own)
        if not isinstance(own, dict):
            raise TypeError(f"the prompt's extra_info[{RESET_KWARGS!r}] is a "
                            f"{type(own).__name__}, not a table of reset arguments")
        result = self.client.reset(**{**self.reset_kwargs, **own})
        return observation_text(result.observation, self.observation_key)

    def step(self, action: str) -> tuple[str, float, bool]:
        result = self.client.step({self.action_key: action})
        return (observation_text(result.observation, self.observation_key),
                float(result.reward or 0.0), bool(result.done))

    def close(self) -> None:
        self.client.close()
