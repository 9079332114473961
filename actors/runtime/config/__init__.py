"""The typed topology: ``topology.toml`` decoded into msgspec Structs, unknown keys rejected.

``schema`` holds the Structs (every field with a one-line docstring), ``checks`` the rules
across fields, ``load`` the TOML reading and dotted overrides. The names below are the public
ones; import them from here.
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
from actors.runtime.config.load import (
    apply_overrides,
    decode_topology,
    load_topology,
)
from actors.runtime.config.schema import (
    BUILTIN_SCORERS,
    BUILTIN_TASKS,
    ActorCommon,
    ConfigError,
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
    VLLMOptions,
)

__all__ = [
    "BUILTIN_SCORERS", "BUILTIN_TASKS", "BUILTIN_TOOLS", "ActorCommon", "AgentConfig", "AgentEnv", "AgentRollout",
    "AgentTool", "AlgorithmConfig", "ConfigError",
    "CorrectionConfig", "DatasetConfig", "FilterGroups", "KLControl", "LearnerConfig",
    "LoraConfig", "ModelConfig", "RejectionRule", "ReplayConfig", "RewardConfig",
    "RewardFunction", "RouterConfig", "RunConfig", "SamplerConfig", "SecurityConfig",
    "TaskConfig", "Topology", "VLLMOptions", "ValidationConfig", "ValidationDataset",
    "apply_overrides", "decode_topology", "load_topology",
]
