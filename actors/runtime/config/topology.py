"""The whole topology: every section, and the rules that tie one section to another's."""

from __future__ import annotations

from actors.runtime.config.agent import AgentConfig
from actors.runtime.config.algorithm import AlgorithmConfig
from actors.runtime.config.data import TaskConfig, ValidationConfig
from actors.runtime.config.estimators import ROWS as ESTIMATORS
from actors.runtime.config.gpus import PlacedProcess
from actors.runtime.config.learner import LearnerConfig
from actors.runtime.config.model import ModelConfig
from actors.runtime.config.ray import RayOptions
from actors.runtime.config.replay import ReplayConfig
from actors.runtime.config.reward import RewardConfig
from actors.runtime.config.router import RouterConfig
from actors.runtime.config.run import RunConfig
from actors.runtime.config.sampler import SamplerConfig
from actors.runtime.config.schema_base import _Section, need
from actors.runtime.config.security import SecurityConfig
from actors.runtime.config.teacher import TeacherConfig


class Topology(_Section, frozen=True):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    sampler: SamplerConfig = SamplerConfig()
    router: RouterConfig = RouterConfig()
    reward: RewardConfig = RewardConfig()
    teacher: TeacherConfig = TeacherConfig()
    replay: ReplayConfig = ReplayConfig()
    learner: LearnerConfig = LearnerConfig()
    security: SecurityConfig = SecurityConfig()
    agent: AgentConfig = AgentConfig()
    validation: ValidationConfig = ValidationConfig()
    ray: RayOptions = RayOptions()
    """The Ray cluster and what each process reserves there (``run.launcher = "ray"``)."""
    hosts: dict[str, str] = {}
    """Host names -> addresses (IP or DNS name) for a job over several machines; each machine
    runs ``runner.py topology.toml --host NAME`` and starts the actors placed on NAME."""
    control_address: str = "auto"
    """Where every actor reports to the runner (ZeroMQ endpoint, or ``auto``)."""
    placement: list[PlacedProcess] = []
    """Filled in by the runner (``actors/runtime/config/gpus.py``): the GPUs and memory share
    of each process it starts; written to topology.json, not set by hand."""

    def __post_init__(self) -> None:
        """What spans sections (a check that looks at the world, files or the machine, is the
        runner's: ``actors/job/config/checks.py``)."""
        L, R, a = self.learner, self.reward, self.algorithm
        need(self.replay.capacity >= L.groups_per_step, "replay.capacity",
             f"must hold at least one batch (learner.groups_per_step = {L.groups_per_step})")
        need(self.replay.reuse <= a.max_staleness + 1, "replay.reuse",
             f"a group can be served at most once per policy version while it is fresh, so at "
             f"most algorithm.max_staleness + 1 = {a.max_staleness + 1} times; raise "
             "max_staleness")
        max_length = R.max_response_length or self.sampler.max_tokens
        need(R.overlong_buffer_len <= max_length, "reward.overlong_buffer_len",
             f"must be <= the response length limit ({max_length})")
        need(not (L.lora.rank > 0 and L.lora.vision and self.model.freeze_vision),
             "learner.lora.vision",
             "adapters on the vision tower would not train with model.freeze_vision = true")
        if self.agent.rollout.path and self.agent.rollout.branches == "train":
            why = "train gives groups of unequal size, which "  # (samples on prompts of their own)
            need(a.adv_estimator.unequal_groups, "agent.rollout.branches",
                 f"{why}{a.adv_estimator.name} cannot take (it normalises over the whole "
                 f"batch); set branches = \"last\" or one of "
                 f"{', '.join(n for n, row in ESTIMATORS.items() if row.unequal_groups)}")
            need(L.nproc_per_node * L.nnodes == 1, "agent.rollout.branches",
                 f"{why}learner ranks cannot share out evenly; set branches = \"last\"")
            need(not self.teacher.path, "agent.rollout.branches",
                 "train gives samples on prompts of their own, which the teacher's request (one "
                 "prompt per group) cannot carry yet; with [teacher] set branches = \"last\"")
