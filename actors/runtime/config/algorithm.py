"""The ``[algorithm]`` section of the topology: advantage estimators, policy losses, KL, the
off-policy correction and group filtering, with verl's names.

Its own module so the topology's schema stays one screenful per concern; ``schema.Topology``
holds it as ``algorithm``. Every field has a one-line docstring below it.
"""

from __future__ import annotations

from typing import Literal

from actors.runtime.config.constraints import (
    Finite,
    NonNegFinite,
    NonNegFloat,
    NonNegInt,
    PositiveFinite,
    PositiveFloat,
    PositiveInt,
)
from actors.runtime.config.estimators import EstimatorChoice, Grpo
from actors.runtime.config.losses import PolicyLossChoice, Vanilla
from actors.runtime.config.schema_base import ConfigError, _Section, need
from kernels import rollout_options  # torch-free: the rules the learner's kernels apply

KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                 "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"]
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"]


class RejectionRule(_Section, frozen=True):
    statistic: Literal["ratio", "geo_mean", "k1", "k2", "k3"]
    """What is bounded: the IS ratio, its per-sequence geometric mean, or a KL statistic of it."""
    level: Literal["token", "sequence"] = "sequence"
    """Mask single tokens, or every token of a sequence whose statistic is out of bounds."""
    low: Finite | None = None
    """Lower bound, kept when statistic >= low (none: unbounded below; k1 can be negative)."""
    high: Finite | None = None
    """Upper bound, kept when statistic <= high (none: unbounded above)."""
    reduce: Literal["mean", "sum", "max"] = "mean"
    """Sequence level, k1/k2/k3: how the token statistics of a sequence become its statistic
    (verl ``seq_mean_k*``, ``seq_sum_k*``, ``seq_max_k*``)."""


HERE = "algorithm.correction"  # where the section is, for an error naming another of its keys


class CorrectionConfig(_Section, frozen=True):
    mode: Literal["decoupled", "bypass"] = "decoupled"
    """decoupled: proximal log-probs recomputed, PPO on π_θ/π_old, tokens weighted by π_old/μ;
    bypass (verl ``rollout_correction.bypass_mode``): the sampler's behaviour log-probs are the
    PPO old log-probs (no recompute). The IS and rejection options below act in bypass mode only
    with ``algorithm.policy_loss = "bypass_mode"``, which applies them to π_θ/μ in the loss."""
    is_level: Literal["token", "sequence", "none"] = "token"
    """Truncated importance weight min(π_old/μ, is_cap) per token, per sequence, or none
    (verl ``rollout_is``)."""
    is_cap: PositiveFinite = 2.0
    """Cap of the truncated importance weight (verl ``rollout_is_threshold``: verl 2.0, AReaL
    5.0, TRL 3.0)."""
    is_low: Finite | None = None
    """IcePop band: weights outside [is_low, is_cap] become 0 instead of being capped (verl
    ``rollout_is_threshold = "is_low_is_cap"``); none: truncated IS."""
    normalize_weights: bool = False
    """Rescale the importance weights of a batch to mean 1 (verl ``rollout_is_batch_normalize``)."""
    rejection: list[RejectionRule] = []
    """Masked IS / rejection rules (IcePop, verl rollout_rs); a token is kept only if all keep it."""
    rollout_rs: str = ""
    """verl's rejection options, comma-separated (``token_k1|k2|k3``, ``seq_sum_k1|k2|k3``,
    ``seq_mean_k1|k2|k3``, ``seq_max_k2|k3``); their rules join ``rejection``. Empty: none."""
    rollout_rs_threshold: str | PositiveFinite = ""
    """verl's thresholds for ``rollout_rs``, one per option or one for all (comma-separated):
    for k1 ``"lower_upper"`` or a number u (meaning ``"1/u_u"``), bounds on 1/ρ = π_behav/π_old
    as verl's code reads them (``"0.5_2.0"`` keeps ρ in [0.5, 2]); for k2/k3 one upper bound."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """``policy_loss = "bypass_mode"``: PPO clip on π_θ/μ (the clipped ratio is the correction;
    IS weights only logged) or REINFORCE weighted by the IS weights of π_θ/μ (verl
    ``rollout_correction.loss_type``)."""

    def __post_init__(self) -> None:
        need(self.is_low is None or 0 < self.is_low <= self.is_cap, "is_low",
             f"must be in (0, is_cap = {self.is_cap}]")
        need(self.is_low is None or self.is_level != "none", "is_low",
             "an IcePop band needs IS weights: set is_level to token or sequence")
        self.rejection_rules()
        need(bool(self.rollout_rs) or self.rollout_rs_threshold == "", "rollout_rs_threshold",
             "is set but rollout_rs is empty")

    def rejection_rules(self) -> list[rollout_options.RejectionRule]:
        """Every rejection rule, as the learner's kernels apply them: ``rejection``, then
        ``rollout_rs``'s presets, each statistic bounded once (a ``ConfigError`` naming the key
        within the section otherwise)."""
        rules: list[rollout_options.RejectionRule] = []
        names: dict[str, str] = {}  # statistic -> the key path that bounds it
        for i, r in enumerate(self.rejection):
            try:
                rule = rollout_options.RejectionRule(r.statistic, r.level, r.low, r.high, r.reduce)
            except ValueError as exc:
                raise ConfigError(f"rejection[{i}]: {exc}") from None
            need(rule.name not in names, f"rejection[{i}]",
                 f"a second rule for {rule.name} (after {names.get(rule.name)}); merge their "
                 "bounds")
            names[rule.name] = f"{HERE}.rejection[{i}]"
            rules.append(rule)
        if self.rollout_rs:
            need(self.rollout_rs_threshold != "", "rollout_rs_threshold",
                 "rollout_rs needs its thresholds (verl has no default)")
            try:
                presets = rollout_options.parse_rs_preset(self.rollout_rs,
                                                          self.rollout_rs_threshold)
            except ValueError as exc:
                raise ConfigError(f"rollout_rs: {exc}") from None
            for rule in presets:
                need(rule.name not in names, "rollout_rs",
                     f"{rule.name} is already a rule of {names.get(rule.name)}")
                names[rule.name] = f"{HERE}.rollout_rs"
                rules.append(rule)
        return rules


class KLControl(_Section, frozen=True):
    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or adaptive towards target_kl (verl kl_ctrl)."""
    kl_coef: NonNegFinite = 0.001
    """Initial β of the KL penalty in the reward."""
    target_kl: PositiveFloat = 0.1
    """adaptive: the KL the controller steers to."""
    horizon: PositiveInt = 10000
    """adaptive: steps over which β moves by at most 20%."""


class FilterGroups(_Section, frozen=True):
    enable: bool = False
    """Drop every group whose samples all got the same reward (it has no learning signal) and
    admit replacement prompts until the batch is full."""
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    """verl's metric names; here all of them are the sample's reward (the scorers' score)."""
    max_num_gen_batches: NonNegInt = 0
    """Stop the job with an error when more than this many batches' worth of groups
    (× learner.groups_per_step) are filtered between two served batches (0: no limit)."""


class AlgorithmConfig(_Section, frozen=True):
    adv_estimator: EstimatorChoice = Grpo()
    """The advantage estimator, by name (verl's; a peer's where verl has none), with its own
    options (``[algorithm.adv_estimator]``, ``name = "gae"``, ``lam = 0.95``; a name alone is
    enough); custom is your own (``path``, ``function``, ``kwargs``; docs/algorithms.md). Each
    estimator's row, with what it needs of the job (a greedy sample, a critic, π_old's forward)
    and its options: actors/runtime/config/estimators.py."""
    n: PositiveInt = 8
    """Completions sampled per prompt (the group size; verl ``rollout.n``)."""
    policy_loss: PolicyLossChoice = Vanilla()
    """The policy loss, by name (verl's; a peer's where verl has none), with its own options
    (``[algorithm.policy_loss]``, ``name = "sapo"``, ``tau_pos = 1.0``; a name alone is
    enough); custom is your own (``path``, ``function``, ``kwargs``; docs/algorithms.md). Each
    loss's row, with its traits and options: actors/runtime/config/losses.py."""
    clip_ratio_low: NonNegFloat = 0.2
    """PPO clip ε_low (geo_mean: a log-ratio range, GMPO uses 0.4; dppo_*: the divergence
    threshold for negative advantages)."""
    clip_ratio_high: NonNegFloat = 0.2
    """PPO clip ε_high (> ε_low is DAPO clip-higher; geo_mean, dppo_*: as clip_ratio_low)."""
    clip_ratio_c: NonNegFinite = 3.0
    """Dual-clip constant c > 1 for negative advantages (0 disables); dppo_*: the cap of the
    truncated ratio (0: verl's fallback 20)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses are reduced (verl names), over the whole mini-batch (token-sum: no
    normaliser, the loss grows with the token count)."""
    loss_scale_factor: NonNegFinite = 0.0
    """seq-mean-token-sum-norm: the constant to divide by (0: sampler.max_tokens)."""
    entropy_coeff: NonNegFloat = 0.0
    """Entropy bonus: loss −= entropy_coeff·H."""
    use_kl_loss: bool = False
    """Add kl_loss_coef·KL(π_θ‖π_ref) to the loss, against the frozen initial model."""
    kl_loss_coef: NonNegFinite = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: KLType = "low_var_kl"
    """KL estimator of the loss term (``k3+`` etc.: that value with the gradient of k2)."""
    use_kl_in_reward: bool = False
    """Subtract β·KL(π_old‖π_ref) per token from the reward."""
    kl_penalty: KLType = "kl"
    """KL estimator of the in-reward penalty (a ``+`` kind is its base kind here: no gradient)."""
    kl_ctrl: KLControl = KLControl()
    """Controller of β for the in-reward penalty."""
    correction: CorrectionConfig = CorrectionConfig()
    """Off-policy correction between the sampler's policy μ and the learner's."""
    max_staleness: NonNegInt = 1
    """Policy versions a sample may lag the learner (0 = synchronous). Older groups are dropped."""
    filter_groups: FilterGroups = FilterGroups()
    """DAPO dynamic sampling: drop groups whose rewards are all equal (verl
    ``algorithm.filter_groups``)."""

    def __post_init__(self) -> None:
        loss, estimator = self.policy_loss, self.adv_estimator
        need(self.clip_ratio_low < 1 or not loss.clip_is_ratio, "clip_ratio_low",
             f"must be < 1 with policy_loss = {loss.name!r}")
        need(self.clip_ratio_c == 0 or self.clip_ratio_c > 1, "clip_ratio_c",
             "must be > 1 (or 0: off)")
        need(self.n >= estimator.min_group, "n",
             f"{estimator.name} needs groups of >= {estimator.min_group}")
        need(not self.filter_groups.enable or self.n >= 2, "filter_groups.enable",
             "needs algorithm.n >= 2 (a group of one always has equal rewards)")
        c = self.correction
        if c.mode == "bypass":
            need(loss.takes_correction or not c.rejection_rules(), "correction.rejection",
                 "in bypass mode there is no π_old to compare μ with: rejection acts only with "
                 "algorithm.policy_loss = \"bypass_mode\" (on π_θ/μ)")
            need(not estimator.old_forward, "adv_estimator",
                 f"{estimator.name} needs π_old's forward pass (sum_pi_squared), which bypass "
                 "mode skips (verl: the same); use correction.mode = \"decoupled\"")
        need(not loss.takes_correction or c.mode == "bypass", "policy_loss",
             "bypass_mode takes the behaviour log-probs as the old log-probs: set "
             "algorithm.correction.mode = \"bypass\" (verl: rollout_correction.bypass_mode = "
             "true)")
