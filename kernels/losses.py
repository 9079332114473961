"""The learner's losses in one import: aggregation, policy losses, the critic's value loss.

Each lives in its own module (``kernels.aggregate``, ``kernels.policy_losses``,
``kernels.value_loss``); this module re-exports them. See ``kernels.aggregate`` for how
``token_count`` / ``seq_count`` make micro-batch losses add up to the mini-batch loss.
"""

from __future__ import annotations

from kernels.aggregate import AGG_MODES, aggregate
from kernels.policy_losses import (
    DEFAULT_AGG_MODES,
    POLICY_LOSSES,
    bypass_mode_loss,
    cispo_loss,
    clip_cov_loss,
    dppo_kl_loss,
    dppo_tv_loss,
    dro_loss,
    geo_mean_loss,
    gspo_loss,
    kl_cov_loss,
    policy_loss,
    ppo_clip_loss,
    reinforce_loss,
    sapo_loss,
)
from kernels.ratios import LOG_RATIO_BOUND
from kernels.value_loss import value_loss

__all__ = [
    "AGG_MODES",
    "DEFAULT_AGG_MODES",
    "LOG_RATIO_BOUND",
    "POLICY_LOSSES",
    "aggregate",
    "bypass_mode_loss",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "geo_mean_loss",
    "gspo_loss",
    "kl_cov_loss",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_loss",
    "sapo_loss",
    "value_loss",
]
