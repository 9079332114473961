"""The ``agent`` keys' rules (tools, environment, a user rollout function) and what a rollout
function that branches asks of the rest of the job; ``need(ok, key, why)`` raises naming the
key (``checks.py`` calls them)."""

from __future__ import annotations

from pathlib import Path

from actors.runtime.config.agent import AgentConfig
from actors.runtime.config.estimators import UNEQUAL_GROUP_ESTIMATORS
from actors.runtime.config.schema import Topology
from actors.runtime.config.schema_base import need


def check_agent(A: AgentConfig) -> None:
    need(A.memory_mb == 0 or A.memory_mb >= 128, "agent.memory_mb",
         "must be >= 128 (a Python child needs that much address space) or 0 (no limit)")
    need(not (A.tools and A.env.path), "agent.env.path",
         "an environment replaces tools: set agent.tools or agent.env, not both")
    names: dict[str, int] = {}
    for i, tool in enumerate(A.tools):
        key = f"agent.tools[{i}]"
        need(bool(tool.builtin) != bool(tool.path), key, "set either builtin or path (one of them)")
        if not tool.builtin:
            need(Path(tool.path).is_file(), f"{key}.path", f"no file {tool.path!r}")
            need(bool(tool.name), f"{key}.name", "must name the tool's function in path")
        name = tool.name or tool.builtin
        need(name not in names, f"{key}.name",
             f"{name!r} is already the name of agent.tools[{names.get(name)}]")
        names[name] = i
    if A.env.path:
        need(Path(A.env.path).is_file(), "agent.env.path", f"no file {A.env.path!r}")
        need(bool(A.env.name), "agent.env.name", "must name the environment's class in path")
    else:
        need(not A.env.name, "agent.env.name", "needs agent.env.path")
    check_rollout(A)


def check_branches(topology: Topology) -> None:
    R, a, L = topology.agent.rollout, topology.algorithm, topology.learner
    if R.path and R.branches == "train":  # groups of unequal size
        why = "train gives groups of unequal size, which "
        need(a.adv_estimator.unequal_groups, "agent.rollout.branches",
             f"{why}{a.adv_estimator.name} cannot take (it normalises over the whole batch); set "
             f"branches = \"last\" or one of {', '.join(UNEQUAL_GROUP_ESTIMATORS)}")
        need(L.nproc_per_node * L.nnodes == 1, "agent.rollout.branches",
             f"{why}learner ranks cannot share out evenly; set branches = \"last\"")
        need(not topology.teacher.path, "agent.rollout.branches",
             "train gives samples on prompts of their own, which the teacher's request (one "
             "prompt per group) cannot carry yet; with [teacher] set branches = \"last\"")


def check_rollout(A: AgentConfig) -> None:
    R = A.rollout
    if not R.path:
        return
    need(not (A.tools or A.env.path), "agent.rollout.path",
         "a rollout function replaces tools and environments: set one of agent.tools, "
         "agent.env, agent.rollout")
    need(Path(R.path).is_file(), "agent.rollout.path", f"no file {R.path!r}")
