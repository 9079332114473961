"""The policy losses' options, ``[algorithm.policy_loss]``: one Struct per loss of
``kernels/policy_losses`` (the kernel is the loss; this is its row in the config), selected by
its ``name`` (a tagged union), each holding the options that loss alone takes under verl's
names, with their ranges and checks. The learner passes a row's fields to the kernel as they
are (``objective.micro_batch_loss``): a field is a keyword argument of that loss's function
(``tests/test_config_losses.py`` ties each row to its kernel). Adding a loss is its kernel file
and its row here.

``algorithm.policy_loss = "sapo"`` (a name alone) still reads as ``{name = "sapo"}``, and the
options' old flat keys (``algorithm.tau_pos``, ...) as that table's, with a one-line notice
(``load.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from actors.runtime.config import custom
from actors.runtime.config.constraints import (
    FilePath,
    Finite,
    NonNegFloat,
    PositiveFloat,
    PythonName,
    Share,
)
from actors.runtime.config.schema_base import _Section

if TYPE_CHECKING:
    from actors.runtime.config.algorithm import CorrectionConfig


class PolicyLossRow(_Section, frozen=True, tag_field="name"):
    """What every loss's row is: its ``name`` picks the Struct. Its class attributes say how
    the rest of the job treats it (read there instead of its name)."""

    clip_is_ratio: ClassVar[bool] = True  # clip_ratio_low/high bound a ratio (so low < 1)
    takes_correction: ClassVar[bool] = False  # corrects π_θ against μ itself (bypass mode)

    def weights_in_loss(self, correction: CorrectionConfig) -> bool:
        """Whether the loss multiplies by the correction's IS weights of π_θ/μ (else they
        are only logged, the rejection's mask applied)."""
        return False

    @property
    def name(self) -> str:
        return str(type(self).__struct_config__.tag)

    def code(self) -> str | custom.UserFunction:
        """What ``kernels.policy_losses.policy_loss`` runs: a built-in's name, or the loaded
        function of a ``custom`` row."""
        return self.name

    def kernel_options(self) -> dict[str, Any]:
        """The loss's own keyword arguments: a built-in row's fields (verl's names)."""
        return msgspec.structs.asdict(self)


class Vanilla(PolicyLossRow, frozen=True, tag="vanilla"):
    """PPO clip (dual clip with ``clip_ratio_c``)."""


class Gspo(PolicyLossRow, frozen=True, tag="gspo"):
    """GSPO: the sequence-level ratio."""


class Reinforce(PolicyLossRow, frozen=True, tag="reinforce"):
    """REINFORCE on the importance-weighted advantage."""


class Gpg(PolicyLossRow, frozen=True, tag="gpg"):
    """GPG: verl's name for reinforce."""


class Cispo(PolicyLossRow, frozen=True, tag="cispo"):
    """CISPO: clipped importance weights, every token's gradient kept."""


class Sapo(PolicyLossRow, frozen=True, tag="sapo"):
    """SAPO: a soft gate in place of the clip."""

    tau_pos: PositiveFloat = 1.0
    """Temperature of the gate for positive advantages (verl ``actor.tau_pos``)."""
    tau_neg: PositiveFloat = 1.05
    """Temperature of the gate for negative advantages (verl ``actor.tau_neg``)."""


class GeoMean(PolicyLossRow, frozen=True, tag="geo_mean"):
    """GMPO: the geometric mean of the token ratios, clipped in log space."""

    clip_is_ratio: ClassVar[bool] = False  # a log-ratio range (GMPO uses 0.4)


class ClipCov(PolicyLossRow, frozen=True, tag="clip_cov"):
    """Clip-Cov: the gradient of a budget of high-covariance tokens dropped."""

    clip_cov_ratio: Share = 0.0002
    """Share of tokens whose gradient is dropped (verl ``policy_loss.clip_cov_ratio``)."""
    clip_cov_lb: Finite = 1.0
    """Lower bound of the covariance of the tokens that may be dropped."""
    clip_cov_ub: Finite = 5.0
    """Upper bound of that covariance (> clip_cov_lb)."""

    def __post_init__(self) -> None:
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"clip_cov_ub must be > clip_cov_lb = {self.clip_cov_lb} "
                             f"(got {self.clip_cov_ub})")


class KlCov(PolicyLossRow, frozen=True, tag="kl_cov"):
    """KL-Cov: a KL penalty on a budget of high-covariance tokens."""

    kl_cov_ratio: Share = 0.0002
    """Share of tokens that get the KL penalty (verl ``policy_loss.kl_cov_ratio``)."""
    ppo_kl_coef: NonNegFloat = 0.1
    """Coefficient of that penalty |lp − lp_old| (verl ``policy_loss.ppo_kl_coef``)."""


class DppoTv(PolicyLossRow, frozen=True, tag="dppo_tv"):
    """DPPO with the total-variation divergence."""

    clip_is_ratio: ClassVar[bool] = False  # a divergence threshold


class DppoKl(PolicyLossRow, frozen=True, tag="dppo_kl"):
    """DPPO with the KL divergence."""

    clip_is_ratio: ClassVar[bool] = False  # a divergence threshold


class Dro(PolicyLossRow, frozen=True, tag="dro"):
    """DRO: a quadratic penalty on lp − lp_old."""

    dro_beta: PositiveFloat
    """Coefficient of the penalty (verl ``policy_loss.dro_beta``; no default: must be set)."""


class BypassMode(PolicyLossRow, frozen=True, tag="bypass_mode"):
    """PPO clip or REINFORCE on π_θ/μ with the correction's IS and rejection options
    (``algorithm.correction``, whose mode must be bypass)."""

    takes_correction: ClassVar[bool] = True

    def weights_in_loss(self, correction: CorrectionConfig) -> bool:
        return correction.loss_type == "reinforce"  # ppo_clip: the clipped ratio corrects


class Custom(PolicyLossRow, frozen=True, tag="custom"):
    """A loss of your own: ``function`` of the Python file ``path``, called as the built-ins
    are (docs/algorithms.md, "Your own loss or estimator")."""

    path: FilePath
    """The Python file, relative to the topology file's directory."""
    function: PythonName
    """The loss in it: ``(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high,
    dual_clip, weights, loss_agg_mode, token_count, seq_count, norm_constant, **kwargs)`` ->
    ``(loss, metrics)``."""
    kwargs: dict[str, Any] = {}
    """Its own options, passed as keyword arguments (checked against its signature)."""
    sha256: str = ""
    """The file's sha256: filled in when the topology is loaded and recorded with the run; the
    learner refuses the file when its content differs (so a rerun computes what the run did)."""

    def code(self) -> custom.UserFunction:
        return custom.load_function("algorithm.policy_loss", self.path, self.function,
                                    self.sha256, self.kwargs, "policy_loss")

    def kernel_options(self) -> dict[str, Any]:
        return {}  # bound to the function by code()


PolicyLossChoice = (Vanilla | Gspo | Reinforce | Gpg | Cispo | Sapo | GeoMean | ClipCov | KlCov
                    | DppoTv | DppoKl | Dro | BypassMode | Custom)
ROWS: dict[str, type[PolicyLossRow]] = {
    str(row.__struct_config__.tag): row for row in PolicyLossChoice.__args__}  # type: ignore[attr-defined]
