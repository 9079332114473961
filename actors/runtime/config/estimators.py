"""The advantage estimators' options, ``[algorithm.adv_estimator]``: one Struct per estimator
of ``kernels/advantages`` (the kernel is the estimator; this is its row in the config),
selected by its ``name`` (a tagged union), each holding the options that estimator alone
takes under verl's names, with their ranges and checks, and saying what it needs from the
rest of the job (class attributes the learner, the sampler and the checks read instead of
naming estimators): a greedy sample per prompt (remax), a critic (gae), π_old's forward before
the advantages (the optimal token baselines), groups of at least two, groups of unequal size.
``kernel_options`` gives ``compute_advantages`` its keyword arguments. Adding an estimator is
its kernel file and its row here (``tests/test_config_estimators.py`` ties each row to its
kernel).

``algorithm.adv_estimator = "rloo"`` (a name alone) still reads as ``{name = "rloo"}``, and the
options' old flat keys (``algorithm.gamma``, ...) as that table's, with a one-line notice
(``load.py``)."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from actors.runtime.config import custom
from actors.runtime.config.constraints import (
    FilePath,
    Finite,
    Fraction,
    PositiveFinite,
    PythonName,
)
from actors.runtime.config.schema_base import _Section


class EstimatorRow(_Section, frozen=True, tag_field="name"):
    """What every estimator's row is: its ``name`` picks the Struct."""

    greedy_baseline: ClassVar[bool] = False  # the sampler adds a greedy sample per prompt
    critic: ClassVar[bool] = False  # the learner trains a value model
    old_forward: ClassVar[bool] = False  # needs π_old (and Σπ²) before the advantages
    min_group: ClassVar[int] = 1  # samples per prompt it needs (algorithm.n)
    unequal_groups: ClassVar[bool] = True  # takes groups of unequal size (agent branches)

    @property
    def name(self) -> str:
        return str(type(self).__struct_config__.tag)

    def code(self) -> str | custom.UserFunction:
        """What ``kernels.advantages.compute_advantages`` runs: a built-in's name, or the loaded
        function of a ``custom`` row."""
        return self.name

    def kernel_options(self) -> dict:
        """``compute_advantages``' keyword arguments from this row's options."""
        return msgspec.structs.asdict(self)

    def reward_keys(self) -> list[str]:
        """The reward components it takes beside the reward, keys of the scorer's result dict
        (the learner hands them as ``reward_components``); none for most."""
        return []


class _NormByStd(EstimatorRow, frozen=True):
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group's std (false is Dr.GRPO; verl ``norm_adv_by_std_in_grpo``)."""

    def kernel_options(self) -> dict:
        return {"norm_adv_by_std": self.norm_adv_by_std_in_grpo}


class _Discounted(EstimatorRow, frozen=True):
    gamma: Fraction = 1.0
    """Discount of the per-token returns (verl's ``algorithm`` key ``gamma``)."""


class Grpo(_NormByStd, frozen=True, tag="grpo"):
    """GRPO: each sample's reward against its group's mean (and std)."""


class DrGrpo(EstimatorRow, frozen=True, tag="dr_grpo"):
    """Dr.GRPO: against the group's mean, no std."""

    min_group: ClassVar[int] = 2


class Rloo(EstimatorRow, frozen=True, tag="rloo"):
    """RLOO: against the mean of the group's other samples."""

    min_group: ClassVar[int] = 2


class ReinforcePlusPlus(_Discounted, frozen=True, tag="reinforce_plus_plus"):
    """REINFORCE++: discounted returns, whitened over the batch."""


class ReinforcePlusPlusBaseline(EstimatorRow, frozen=True, tag="reinforce_plus_plus_baseline"):
    """REINFORCE++ with the group mean as baseline, whitened over the batch."""

    unequal_groups: ClassVar[bool] = False  # normalises over the whole batch


class Remax(_Discounted, frozen=True, tag="remax"):
    """ReMax: against the reward of a greedy sample of the same prompt."""

    greedy_baseline: ClassVar[bool] = True


class Gae(_Discounted, frozen=True, tag="gae"):
    """GAE with a critic (a value model the learner trains beside the policy)."""

    critic: ClassVar[bool] = True
    lam: Fraction = 1.0
    """GAE λ (verl's ``algorithm`` key ``lam``)."""
    cliprange_value: PositiveFinite = 0.5
    """Value clipping range of the critic loss (verl ``critic.cliprange_value``)."""

    def kernel_options(self) -> dict:
        return {"gamma": self.gamma, "lam": self.lam}


class Opo(EstimatorRow, frozen=True, tag="opo"):
    """OPO: against the group's length-weighted mean reward."""

    min_group: ClassVar[int] = 2


class GrpoPassk(_NormByStd, frozen=True, tag="grpo_passk"):
    """GRPO pass@k: only the group's best sample gets an advantage."""

    min_group: ClassVar[int] = 2


class Gpg(EstimatorRow, frozen=True, tag="gpg"):
    """GPG: the group-mean baseline, rescaled by the share of samples with a signal."""

    unequal_groups: ClassVar[bool] = False  # normalises over the whole batch


class OptimalTokenBaseline(EstimatorRow, frozen=True, tag="optimal_token_baseline"):
    """The optimal token baseline (needs π_old's forward: decoupled correction)."""

    old_forward: ClassVar[bool] = True


class TirOptimalTokenBaseline(EstimatorRow, frozen=True, tag="tir_optimal_token_baseline"):
    """The optimal token baseline of tool-integrated rollouts (needs π_old's forward)."""

    old_forward: ClassVar[bool] = True


class Gdpo(_NormByStd, frozen=True, tag="gdpo"):
    """GDPO: each reward component normalised within its group on its own, then summed."""

    unequal_groups: ClassVar[bool] = False  # normalises over the whole batch
    gdpo_reward_keys: list[str] = []
    """The reward components, keys of the scorer's result dict (``compute_score`` returning
    ``{"score": ..., "format_reward": ...}``; with several ``[[reward.functions]]``, each
    function's label holds its score), each normalised within its group on its own."""
    gdpo_reward_weights: list[Finite] = []
    """One weight per key in gdpo_reward_keys (empty: all 1.0)."""

    def kernel_options(self) -> dict:
        return {**super().kernel_options(), "reward_weights": self.gdpo_reward_weights or None}

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

    def code(self) -> custom.UserFunction:
        return custom.load_function("algorithm.adv_estimator", self.path, self.function,
                                    self.sha256, self.kwargs, "adv_estimator")

    def kernel_options(self) -> dict:
        return {}  # bound to the function by code()


EstimatorChoice = (Grpo | DrGrpo | Rloo | ReinforcePlusPlus | ReinforcePlusPlusBaseline | Remax
                   | Gae | Opo | GrpoPassk | Gpg | OptimalTokenBaseline | TirOptimalTokenBaseline
                   | Gdpo | Custom)
ROWS: dict[str, type[EstimatorRow]] = {
    str(row.__struct_config__.tag): row for row in EstimatorChoice.__args__}  # type: ignore[attr-defined]
UNEQUAL_GROUP_ESTIMATORS = tuple(sorted(n for n, r in ROWS.items() if r.unequal_groups))
