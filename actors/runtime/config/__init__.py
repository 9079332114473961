"""The typed topology every actor receives: msgspec Structs (every field with a one-line
docstring) and ``ConfigError``. The names below are the public ones; import them from here.

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
from actors.runtime.config.schema import (
    BUILTIN_SCORERS,
    BUILTIN_TASKS,
    DatasetConfig,
    LearnerConfig,
    LoraConfig,
    ModelConfig,
    ReplayConfig,
    RewardConfig,
    RewardFunction,
    RouterConfig,
    RunConfig,
    SamplerConfig,
    SecurityConfig,
    TaskConfig,
    Topology,
    ValidationConfig,
    ValidationDataset,
)
from actors.runtime.config.schema_base import ActorCommon, ConfigError

__all__ = [
    "BUILTIN_SCORERS", "BUILTIN_TASKS", "BUILTIN_TOOLS", "ActorCommon", "AgentConfig", "AgentEnv", "AgentRollout",
    "AgentTool", "AlgorithmConfig", "ConfigError",
    "CorrectionConfig", "DatasetConfig", "FilterGroups", "KLControl", "LearnerConfig",
    "LoraConfig", "ModelConfig", "RejectionRule", "ReplayConfig", "RewardConfig",
    "RewardFunction", "RouterConfig", "RunConfig", "SamplerConfig", "SecurityConfig",
    "TaskConfig", "Topology", "ValidationConfig", "ValidationDataset",
]
