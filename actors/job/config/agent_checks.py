"""The files the ``agent`` keys name; ``need(ok, key, why)`` raises naming the key
(``checks.py`` calls it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from actors.runtime.config import AgentConfig, OpenEnvSource, need


def check_agent(A: AgentConfig) -> None:
    """The files the ``agent`` keys name (the section checks its keys' combinations itself)."""
    for i, tool in enumerate(A.tools):
        need(not tool.path or Path(tool.path).is_file(), f"agent.tools[{i}].path",
             f"no file {tool.path!r}")
    need(not A.env.path or Path(A.env.path).is_file(), "agent.env.path", f"no file {A.env.path!r}")
    need(not A.rollout.path or Path(A.rollout.path).is_file(), "agent.rollout.path",
         f"no file {A.rollout.path!r}")
    if A.env.openenv.enabled:
        check_openenv(A.env.openenv)


def check_openenv(source: OpenEnvSource) -> None:
    """The library is installed, and the module of the app a sampler serves is found (from
    where the runner is started, as the server will look); not imported here."""
    from actors.data.openenv_episode import INSTALL

    need(_found("openenv"), "agent.env.openenv", f"openenv-core is not installed: {INSTALL}")
    module = source.app.partition(":")[0]
    need(not module or _found(module), "agent.env.openenv.app",
         f"no module {module!r} importable from {Path.cwd()}")


def _found(module: str) -> bool:
    """``module`` is importable here or from the working directory (where a server looks)."""
    sys.path.insert(0, str(Path.cwd()))
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False
    finally:
        sys.path.remove(str(Path.cwd()))
