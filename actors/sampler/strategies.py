"""The rollout strategies, and the one place a sampler chooses one.

- single-turn: no strategy object; the ``Rollout`` hands prompts to the engine itself.
- ``loop``: tools or an environment driven by the sampler (``agent/loop.AgentLoop``).
- ``endpoint``: the user's agent code against an OpenAI-compatible endpoint
  (``endpoint/strategy.EndpointRollout``).

A strategy has ``start``, ``serve`` (run beside the sampler's work until cancelled),
``aclose``, ``prompt_ids``, ``generate(prompts, ids, n, params)``, ``group_prompt``,
``statistics``, ``broken`` and ``env_reward_only``.
"""

from __future__ import annotations

from typing import Any

from actors.data.chat import ChatTokenizer
from actors.runtime.config import AgentConfig
from actors.sampler.engines.base import Engine


def strategy_name(cfg: AgentConfig) -> str:
    """Which strategy ``[agent]`` asks for: ``single``, ``loop`` or ``endpoint``."""
    if cfg.rollout.path:
        return "endpoint"
    return "loop" if cfg.enabled else "single"


async def start_strategy(engine: Engine, tokenizer: ChatTokenizer, cfg: AgentConfig) -> Any:
    """The multi-turn strategy ``cfg`` names, started (None: single-turn)."""
    name = strategy_name(cfg)
    if name == "single":
        return None
    if name == "endpoint":
        from actors.sampler.endpoint.strategy import EndpointRollout

        strategy: Any = EndpointRollout(engine, tokenizer, cfg)
    else:
        from actors.sampler.agent.loop import AgentLoop

        strategy = AgentLoop(engine, tokenizer, cfg)
    await strategy.start()
    return strategy
