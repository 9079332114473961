"""The policy losses, ``[algorithm.policy_loss]``: one Struct per loss of
``kernels/policy_losses``, selected by its ``name`` (a tagged union). A row is the loss's only
registry: it holds the options that loss alone takes under verl's names (with their ranges and
checks), its traits (class attributes the rest of the job reads instead of its name) and
``load``, which imports its kernel only when it is called (the config stays torch-free). The
kernel takes the row (``kernels.policy_losses.policy_loss(row, ...)``) and passes its fields to
the loss's function as they are, a field a keyword argument of that function
(``tests/test_config_losses.py`` checks each row against its function). Adding a loss is its
kernel file and its row here.

``algorithm.policy_loss = "sapo"`` (a name alone) reads as ``{name = "sapo"}`` (``load.py``)."""

from __future__ import annotations

from collections.abc import Callable
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

    def load(self) -> Callable[..., Any]:
        """The loss's function, its module imported now (torch: only in the learner)."""
        raise NotImplementedError(f"the {self.name} row names no function")

    def kernel_options(self) -> dict[str, Any]:
        """The loss's own keyword arguments: the row's fields, under their names (verl's)."""
        return msgspec.structs.asdict(self)


class Vanilla(PolicyLossRow, frozen=True, tag="vanilla"):
    """PPO clip (dual clip with ``clip_ratio_c``)."""

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.vanilla import ppo_clip_loss

        return ppo_clip_loss


class Gspo(PolicyLossRow, frozen=True, tag="gspo"):
    """GSPO: the sequence-level ratio."""

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.gspo import gspo_loss

        return gspo_loss


class Reinforce(PolicyLossRow, frozen=True, tag="reinforce"):
    """REINFORCE on the importance-weighted advantage."""

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.reinforce import reinforce_loss

        return reinforce_loss


class Gpg(PolicyLossRow, frozen=True, tag="gpg"):
    """GPG: verl's name for reinforce."""

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.reinforce import reinforce_loss

        return reinforce_loss


class Cispo(PolicyLossRow, frozen=True, tag="cispo"):
    """CISPO: clipped importance weights, every token's gradient kept."""

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.cispo import cispo_loss

        return cispo_loss


class Sapo(PolicyLossRow, frozen=True, tag="sapo"):
    """SAPO: a soft gate in place of the clip (its loss aggregates as verl's does: the kernel)."""

    tau_pos: PositiveFloat = 1.0
    """Temperature of the gate for positive advantages (verl ``actor.tau_pos``)."""
    tau_neg: PositiveFloat = 1.05
    """Temperature of the gate for negative advantages (verl ``actor.tau_neg``)."""

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.sapo import sapo_loss

        return sapo_loss


class GeoMean(PolicyLossRow, frozen=True, tag="geo_mean"):
    """GMPO: the geometric mean of the token ratios, clipped in log space."""

    clip_is_ratio: ClassVar[bool] = False  # a log-ratio range (GMPO uses 0.4)
    # (it ignores loss_agg_mode: a mean over sequences)

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.geo_mean import geo_mean_loss

        return geo_mean_loss


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

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.clip_cov import clip_cov_loss

        return clip_cov_loss


class KlCov(PolicyLossRow, frozen=True, tag="kl_cov"):
    """KL-Cov: a KL penalty on a budget of high-covariance tokens."""

    kl_cov_ratio: Share = 0.0002
    """Share of tokens that get the KL penalty (verl ``policy_loss.kl_cov_ratio``)."""
    ppo_kl_coef: NonNegFloat = 0.1
    """Coefficient of that penalty |lp − lp_old| (verl ``policy_loss.ppo_kl_coef``)."""

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.kl_cov import kl_cov_loss

        return kl_cov_loss


class DppoTv(PolicyLossRow, frozen=True, tag="dppo_tv"):
    """DPPO with the total-variation divergence."""

    clip_is_ratio: ClassVar[bool] = False  # a divergence threshold

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.dppo import dppo_tv_loss

        return dppo_tv_loss


class DppoKl(PolicyLossRow, frozen=True, tag="dppo_kl"):
    """DPPO with the KL divergence."""

    clip_is_ratio: ClassVar[bool] = False  # a divergence threshold

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.dppo import dppo_kl_loss

        return dppo_kl_loss


class Vespo(PolicyLossRow, frozen=True, tag="vespo"):
    """VESPO: REINFORCE scaled by a gamma function of the sequence's ratio (TRL
    ``loss_type = "vespo"``)."""

    vespo_k_pos: NonNegFloat = 2.0
    """Shape k of the weight φ(w) for tokens with A >= 0 (TRL ``vespo_k_pos``)."""
    vespo_lambda_pos: PositiveFloat = 3.0
    """Rate λ of φ(w) for tokens with A >= 0 (TRL ``vespo_lambda_pos``)."""
    vespo_k_neg: NonNegFloat = 3.0
    """Shape k of φ(w) for tokens with A < 0 (TRL ``vespo_k_neg``)."""
    vespo_lambda_neg: PositiveFloat = 2.0
    """Rate λ of φ(w) for tokens with A < 0 (TRL ``vespo_lambda_neg``)."""

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.vespo import vespo_loss

        return vespo_loss


class Dro(PolicyLossRow, frozen=True, tag="dro"):
    """DRO: a quadratic penalty on lp − lp_old."""

    dro_beta: PositiveFloat
    """Coefficient of the penalty (verl ``policy_loss.dro_beta``; no default: must be set)."""

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.dro import dro_loss

        return dro_loss


class BypassMode(PolicyLossRow, frozen=True, tag="bypass_mode"):
    """PPO clip or REINFORCE on π_θ/μ with the correction's IS and rejection options
    (``algorithm.correction``, whose mode must be bypass)."""

    takes_correction: ClassVar[bool] = True

    def weights_in_loss(self, correction: CorrectionConfig) -> bool:
        return correction.loss_type == "reinforce"  # ppo_clip: the clipped ratio corrects

    def load(self) -> Callable[..., Any]:
        from kernels.policy_losses.bypass import bypass_mode_loss

        return bypass_mode_loss


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

    def load(self) -> custom.UserFunction:
        """The function, read from its file once per process (checked against the recorded
        hash then), with ``kwargs`` bound: a custom row's options are its function's own."""
        return custom.load_function("algorithm.policy_loss", self.path, self.function,
                                    self.sha256, self.kwargs, "policy_loss")

    def kernel_options(self) -> dict[str, Any]:
        return {}  # kwargs: bound to the function by load()


PolicyLossChoice = (Vanilla | Gspo | Reinforce | Gpg | Cispo | Sapo | GeoMean | ClipCov | KlCov
                    | DppoTv | DppoKl | Vespo | Dro | BypassMode | Custom)
ROWS: dict[str, type[PolicyLossRow]] = {
    str(row.__struct_config__.tag): row for row in PolicyLossChoice.__args__}  # type: ignore[attr-defined]
