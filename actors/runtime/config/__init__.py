"""The typed topology every actor receives: msgspec Structs (every field with a one-line
docstring) and ``ConfigError``, one module per section (``run``, ``model``, ``data`` for
``[task]`` and ``[validation]``, ``sampler``, ``router``, ``reward``, ``replay``, ``learner``,
``security``, ``agent``, ``algorithm``, ``teacher``, ...; ``topology`` ties them together). The
names below are the public ones; import them from here.

Reading ``topology.toml``, the dotted overrides and the rules across fields are the runner's
(``actors/job/config/``: ``load``, ``checks``, ``hosts``, ``preflight``, ...): an actor gets its
topology already resolved and never imports them.
"""

from actors.runtime.config.agent import (
    BUILTIN_TOOLS,
    AgentConfig,
    AgentEnv,
    AgentRollout,
    AgentTool,
)
from actors.runtime.config.algorithm import (
    AlgorithmConfig,
    CorrectionConfig,
    FilterGroups,
    KLControl,
    RejectionRule,
)
from actors.runtime.config.data import (
    BUILTIN_TASKS,
    DatasetConfig,
    TaskConfig,
    ValidationConfig,
    ValidationDataset,
)
from actors.runtime.config.learner import LearnerConfig, LoraConfig
from actors.runtime.config.model import ModelConfig
from actors.runtime.config.replay import ReplayConfig
from actors.runtime.config.reward import BUILTIN_SCORERS, RewardConfig, RewardFunction
from actors.runtime.config.router import RouterConfig
from actors.runtime.config.run import RunConfig
from actors.runtime.config.sampler import SamplerConfig
from actors.runtime.config.schema_base import ActorCommon, ConfigError
from actors.runtime.config.security import SecurityConfig
from actors.runtime.config.topology import Topology

__all__ = [
    "BUILTIN_SCORERS", "BUILTIN_TASKS", "BUILTIN_TOOLS", "ActorCommon", "AgentConfig", "AgentEnv", "AgentRollout",
    "AgentTool", "AlgorithmConfig", "ConfigError",
    "CorrectionConfig", "DatasetConfig", "FilterGroups", "KLControl", "LearnerConfig",
    "LoraConfig", "ModelConfig", "RejectionRule", "ReplayConfig", "RewardConfig",
    "RewardFunction", "RouterConfig", "RunConfig", "SamplerConfig", "SecurityConfig",
    "TaskConfig", "Topology", "ValidationConfig", "ValidationDataset",
]
