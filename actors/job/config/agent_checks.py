"""The files the ``agent`` keys name; ``need(ok, key, why)`` raises naming the key
(``checks.py`` calls it)."""

from __future__ import annotations

from pathlib import Path

from actors.runtime.config import AgentConfig, need


def check_agent(A: AgentConfig) -> None:
    """The files the ``agent`` keys name (the section checks its keys' combinations itself)."""
    for i, tool in enumerate(A.tools):
        need(not tool.path or Path(tool.path).is_file(), f"agent.tools[{i}].path",
             f"no file {tool.path!r}")
    need(not A.env.path or Path(A.env.path).is_file(), "agent.env.path", f"no file {A.env.path!r}")
    need(not A.rollout.path or Path(A.rollout.path).is_file(), "agent.rollout.path",
         f"no file {A.rollout.path!r}")
