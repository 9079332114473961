"""The typed topology every actor receives: msgspec Structs (every field with a one-line
docstring) and ``ConfigError``, one module per section (``run``, ``model``, ``data`` for
``[task]`` and ``[validation]``, ``sampler``, ``router``, ``reward``, ``replay``, ``learner``,
``security``, ``agent``, ``algorithm``, ``teacher``, ...; ``topology`` ties them together). The
names below are the public ones: outside this package, import them from here (the one way
in; only a module the config's own tables import, ``actors/runtime/devices.py``, takes its
modules directly).

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
    OpenEnvSource,
)
from actors.runtime.config.algorithm import (
    AlgorithmConfig,
    CorrectionConfig,
    FilterGroups,
    KLControl,
    RejectionRule,
)
from actors.runtime.config.constraints import BIG, refusal
from actors.runtime.config.custom import ROLES, UserCodeError, call_problem, file_sha256
from actors.runtime.config.data import (
    BUILTIN_TASKS,
    DatasetConfig,
    TaskConfig,
    ValidationConfig,
    ValidationDataset,
)
from actors.runtime.config.engines import (
    ENGINES,
    FALLBACK,
    AutoEngine,
    Decode,
    EngineRow,
    HFOptions,
    VLLMOptions,
    sampler_engine,
    vllm_problem,
)
from actors.runtime.config.estimators import ROWS as ESTIMATOR_ROWS
from actors.runtime.config.estimators import Custom as CustomEstimator
from actors.runtime.config.estimators import Gae
from actors.runtime.config.gpus import (
    DEVICE_ENV,
    MIN_SHARE,
    SHARED_BUDGET,
    PlacedProcess,
    auto_device,
    on_gpu,
    process_share,
    visible_gpus,
)
from actors.runtime.config.learner import LearnerConfig, LoraConfig
from actors.runtime.config.losses import ROWS as LOSS_ROWS
from actors.runtime.config.losses import Custom as CustomLoss
from actors.runtime.config.model import ModelConfig
from actors.runtime.config.names import ProcessName, of_kind
from actors.runtime.config.placement import auto_dtype, check_placement, samplers_dtype
from actors.runtime.config.pools import (
    RULES_POOL,
    JudgeConfig,
    RewardModelConfig,
    ServedModel,
    check_served,
    model_replica,
    reward_processes,
    score_targets,
    served_devices,
)
from actors.runtime.config.ray import ray_problem
from actors.runtime.config.replay import ReplayConfig
from actors.runtime.config.reward import BUILTIN_SCORERS, RewardConfig, RewardFunction
from actors.runtime.config.router import RouterConfig
from actors.runtime.config.run import RunConfig
from actors.runtime.config.sampler import SamplerConfig
from actors.runtime.config.schema_base import ActorCommon, ConfigError, need
from actors.runtime.config.security import SecurityConfig
from actors.runtime.config.sources import ReasoningGymSource, VerifiersSource
from actors.runtime.config.teacher import check_teacher
from actors.runtime.config.topology import Topology

__all__ = [
    "ActorCommon", "AgentConfig", "AgentEnv", "AgentRollout", "AgentTool", "AlgorithmConfig",
    "AutoEngine",
    "BIG", "BUILTIN_SCORERS", "BUILTIN_TASKS", "BUILTIN_TOOLS", "ConfigError",
    "CorrectionConfig", "CustomEstimator", "CustomLoss", "DEVICE_ENV", "DatasetConfig",
    "Decode", "ENGINES", "ESTIMATOR_ROWS", "EngineRow", "FALLBACK", "FilterGroups", "Gae",
    "HFOptions",
    "JudgeConfig", "KLControl", "LOSS_ROWS", "LearnerConfig", "LoraConfig", "MIN_SHARE",
    "ModelConfig", "OpenEnvSource", "PlacedProcess", "ProcessName", "ROLES", "RULES_POOL", "ReasoningGymSource",
    "RejectionRule", "ReplayConfig", "RewardConfig", "RewardFunction", "RewardModelConfig",
    "RouterConfig", "RunConfig", "SHARED_BUDGET", "SamplerConfig", "SecurityConfig",
    "ServedModel", "TaskConfig", "Topology", "UserCodeError", "VLLMOptions",
    "ValidationConfig", "ValidationDataset", "VerifiersSource", "auto_device", "auto_dtype",
    "call_problem", "check_placement", "check_served", "check_teacher",
    "file_sha256", "model_replica", "need", "of_kind", "on_gpu", "process_share",
    "ray_problem", "refusal", "reward_processes", "sampler_engine", "samplers_dtype",
    "score_targets", "served_devices", "visible_gpus", "vllm_problem",
]
