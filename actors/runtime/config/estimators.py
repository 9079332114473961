"""The advantage estimators, ``[algorithm.adv_estimator]``: one Struct per estimator of
``kernels/advantages``, selected by its ``name`` (a tagged union). A row is the estimator's
only registry: it holds the options that estimator alone takes under verl's names (with their
ranges and checks), ``load``, which imports its kernel only when it is called (the config stays
torch-free), and what it needs from the rest of the job (class attributes the learner, the
sampler, the checks and the kernel read instead of naming estimators): a greedy sample per
prompt (remax), a critic (gae), π_old's forward before the advantages (the optimal token
baselines), groups of at least two, how it treats groups of unequal size. The kernel takes the
row (``kernels.advantages.compute_advantages(row, ...)``) and its fields as they are: each is a
field of ``AdvantageParams`` under the same name, except those a row says another part reads
(``read_elsewhere``). Adding an estimator is its kernel file and its row here
(``tests/test_config_estimators.py`` checks each row against the kernel).

``algorithm.adv_estimator = "rloo"`` (a name alone) reads as ``{name = "rloo"}`` (``load.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import msgspec

from actors.runtime.config import custom
from actors.runtime.config.constraints import FilePath, Finite, Fraction, PositiveFinite, PythonName
from actors.runtime.config.schema_base import _Section


class EstimatorRow(_Section, frozen=True, tag_field="name"):
    """What every estimator's row is: its ``name`` picks the Struct."""

    greedy_baseline: ClassVar[bool] = False  # the sampler adds a greedy sample per prompt
    critic: ClassVar[bool] = False  # the learner trains a value model
    old_forward: ClassVar[bool] = False  # needs π_old (and Σπ²) before the advantages
    min_group: ClassVar[int] = 1  # samples per prompt it needs (algorithm.n)
    grouped: ClassVar[bool] = True  # uses the group (else each row alone: the whole batch at once)
    # takes groups of unequal size (agent branches): a grouped estimator whose advantages
    # depend only on each group's rows, run group by group; not one that whitens or scales
    # over the whole batch
    unequal_groups: ClassVar[bool] = True
    read_elsewhere: ClassVar[tuple[str, ...]] = ()  # its fields the estimator does not take

    @property
    def name(self) -> str:
        return str(type(self).__struct_config__.tag)

    def load(self) -> Callable[..., Any]:
        """The estimator's function, its module imported now (torch: only in the learner)."""
        raise NotImplementedError(f"the {self.name} row names no function")

    def kernel_options(self) -> dict[str, Any]:
        """The estimator's options: the row's fields under their names (``AdvantageParams``'),
        but those another part reads."""
        return {k: v for k, v in msgspec.structs.asdict(self).items()
                if k not in self.read_elsewhere}

    def reward_keys(self) -> list[str]:
        """The reward components it takes beside the reward, keys of the scorer's result dict
        (the learner hands them as ``reward_components``); none for most."""
        return []


class _NormByStd(EstimatorRow, frozen=True):
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group's std (false is Dr.GRPO; verl ``norm_adv_by_std_in_grpo``)."""


class _Discounted(EstimatorRow, frozen=True):
    gamma: Fraction = 1.0
    """Discount of the per-token returns (verl's ``algorithm`` key ``gamma``)."""


class Grpo(_NormByStd, frozen=True, tag="grpo"):
    """GRPO: each sample's reward against its group's mean (and std)."""

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.grpo import grpo

        return grpo


class DrGrpo(EstimatorRow, frozen=True, tag="dr_grpo"):
    """Dr.GRPO: against the group's mean, no std."""

    min_group: ClassVar[int] = 2

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.grpo import dr_grpo

        return dr_grpo


class GrpoBatchStd(EstimatorRow, frozen=True, tag="grpo_batch_std"):
    """GRPO scaled by the batch's std (TRL ``scale_rewards = "batch"``, Lite PPO): each
    sample's reward against its group's mean, divided by the std of all the batch's rewards."""

    min_group: ClassVar[int] = 2
    unequal_groups: ClassVar[bool] = False  # scales over the whole batch

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.grpo import grpo_batch_std

        return grpo_batch_std


class Rloo(EstimatorRow, frozen=True, tag="rloo"):
    """RLOO: against the mean of the group's other samples."""

    min_group: ClassVar[int] = 2

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.rloo import rloo

        return rloo


class ReinforcePlusPlus(_Discounted, frozen=True, tag="reinforce_plus_plus"):
    """REINFORCE++: discounted returns, whitened over the batch."""

    grouped: ClassVar[bool] = False

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.reinforce_plus_plus import reinforce_plus_plus

        return reinforce_plus_plus


class ReinforcePlusPlusBaseline(EstimatorRow, frozen=True, tag="reinforce_plus_plus_baseline"):
    """REINFORCE++ with the group mean as baseline, whitened over the batch."""

    unequal_groups: ClassVar[bool] = False  # normalises over the whole batch

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.reinforce_plus_plus import reinforce_plus_plus_baseline

        return reinforce_plus_plus_baseline


class Remax(_Discounted, frozen=True, tag="remax"):
    """ReMax: against the reward of a greedy sample of the same prompt."""

    greedy_baseline: ClassVar[bool] = True
    grouped: ClassVar[bool] = False

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.remax import remax

        return remax


class Gae(_Discounted, frozen=True, tag="gae"):
    """GAE with a critic (a value model the learner trains beside the policy)."""

    critic: ClassVar[bool] = True
    grouped: ClassVar[bool] = False
    read_elsewhere: ClassVar[tuple[str, ...]] = ("cliprange_value",)  # the critic's loss
    lam: Fraction = 1.0
    """GAE λ (verl's ``algorithm`` key ``lam``)."""
    cliprange_value: PositiveFinite = 0.5
    """Value clipping range of the critic loss (verl ``critic.cliprange_value``)."""

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.gae import gae

        return gae


class Opo(EstimatorRow, frozen=True, tag="opo"):
    """OPO: against the group's length-weighted mean reward."""

    min_group: ClassVar[int] = 2

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.opo import opo

        return opo


class GrpoPassk(_NormByStd, frozen=True, tag="grpo_passk"):
    """GRPO pass@k: only the group's best sample gets an advantage."""

    min_group: ClassVar[int] = 2

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.passk import grpo_passk

        return grpo_passk


class Gpg(EstimatorRow, frozen=True, tag="gpg"):
    """GPG: the group-mean baseline, rescaled by the share of samples with a signal."""

    unequal_groups: ClassVar[bool] = False  # normalises over the whole batch

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.gpg import gpg

        return gpg


class OptimalTokenBaseline(EstimatorRow, frozen=True, tag="optimal_token_baseline"):
    """The optimal token baseline (needs π_old's forward: decoupled correction)."""

    old_forward: ClassVar[bool] = True

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.optimal_token_baseline import optimal_token_baseline

        return optimal_token_baseline


class TirOptimalTokenBaseline(EstimatorRow, frozen=True, tag="tir_optimal_token_baseline"):
    """The optimal token baseline of tool-integrated rollouts (needs π_old's forward)."""

    old_forward: ClassVar[bool] = True

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.optimal_token_baseline import tir_optimal_token_baseline

        return tir_optimal_token_baseline


class Gdpo(_NormByStd, frozen=True, tag="gdpo"):
    """GDPO: each reward component normalised within its group on its own, then summed."""

    unequal_groups: ClassVar[bool] = False  # normalises over the whole batch
    read_elsewhere: ClassVar[tuple[str, ...]] = ("gdpo_reward_keys",)  # the learner's
    gdpo_reward_keys: list[str] = []
    """The reward components, keys of the scorer's result dict (``compute_score`` returning
    ``{"score": ..., "format_reward": ...}``; with several ``[[reward.functions]]``, each
    function's label holds its score), each normalised within its group on its own."""
    gdpo_reward_weights: list[Finite] = []
    """One weight per key in gdpo_reward_keys (empty: all 1.0)."""

    def reward_keys(self) -> list[str]:
        return self.gdpo_reward_keys

    def __post_init__(self) -> None:
        keys = self.gdpo_reward_keys
        if not keys:
            raise ValueError("gdpo needs gdpo_reward_keys: the reward components, keys of the "
                             "scorer's result dict, e.g. [\"format_reward\", \"accuracy_reward\"]")
        if len(set(keys)) != len(keys):
            raise ValueError("gdpo_reward_keys has a key twice")
        if self.gdpo_reward_weights and len(self.gdpo_reward_weights) != len(keys):
            raise ValueError(f"gdpo_reward_weights needs one weight per key ({len(keys)}), or "
                             "none (all 1.0)")

    def load(self) -> Callable[..., Any]:
        from kernels.advantages.gdpo import gdpo

        return gdpo


class Custom(EstimatorRow, frozen=True, tag="custom"):
    """An estimator of your own: ``function`` of the Python file ``path``, called as the
    built-ins are (docs/algorithms.md, "Your own loss or estimator")."""

    unequal_groups: ClassVar[bool] = False  # its groups are AdvantageParams.group_size rows
    path: FilePath
    """The Python file, relative to the topology file's directory."""
    function: PythonName
    """The estimator in it: ``(token_level_rewards, response_mask, params, **kwargs)`` ->
    ``(advantages, returns)``, ``params`` the built-ins' ``AdvantageParams``."""
    kwargs: dict[str, Any] = {}
    """Its own options, passed as keyword arguments (checked against its signature)."""
    sha256: str = ""
    """The file's sha256: filled in when the topology is loaded and recorded with the run; the
    learner refuses the file when its content differs (so a rerun computes what the run did)."""

    def load(self) -> custom.UserFunction:
        """The function, read from its file once per process (checked against the recorded
        hash then), with ``kwargs`` bound: a custom row's options are its function's own."""
        return custom.load_function("algorithm.adv_estimator", self.path, self.function,
                                    self.sha256, self.kwargs, "adv_estimator")

    def kernel_options(self) -> dict[str, Any]:
        return {}  # kwargs: bound to the function by load()


EstimatorChoice = (Grpo | DrGrpo | GrpoBatchStd | Rloo | ReinforcePlusPlus
                   | ReinforcePlusPlusBaseline | Remax | Gae | Opo | GrpoPassk | Gpg
                   | OptimalTokenBaseline | TirOptimalTokenBaseline | Gdpo | Custom)
ROWS: dict[str, type[EstimatorRow]] = {
    str(row.__struct_config__.tag): row for row in EstimatorChoice.__args__}  # type: ignore[attr-defined]
