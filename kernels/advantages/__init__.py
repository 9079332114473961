"""Advantage estimators by verl name, behind one call: ``compute_advantages(name, ...)``.

One module per estimator family; ``ADVANTAGE_ESTIMATORS`` maps each verl name to a function
``(token_level_rewards (N, T), response_mask (N, T), AdvantageParams) -> (advantages,
returns)``. Group-scalar estimators (grpo, dr_grpo, rloo, opo, grpo_passk,
reinforce_plus_plus_baseline) score each sequence by its total reward over its response tokens
and broadcast one advantage over those tokens; reinforce_plus_plus, remax and gae work per
token. The whitening of reinforce_plus_plus(_baseline) and gae is verl's ``masked_whiten``
(``kernels.masked``): mean and Bessel-corrected variance pooled over all response tokens of
the batch, ``(x - mean) / sqrt(var + 1e-8)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.advantages._common import AdvantageParams
from kernels.advantages.gae import gae
from kernels.advantages.grpo import dr_grpo, grpo, grpo_advantages
from kernels.advantages.opo import opo
from kernels.advantages.passk import grpo_passk
from kernels.advantages.reinforce_plus_plus import (
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
)
from kernels.advantages.remax import remax
from kernels.advantages.rloo import rloo

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageParams", "compute_advantages", "grpo_advantages"]

AdvantageFn = Callable[
    [torch.Tensor, torch.Tensor, AdvantageParams], tuple[torch.Tensor, torch.Tensor]
]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_plus_plus": reinforce_plus_plus,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline,
    "remax": remax,
    "gae": gae,
    "opo": opo,
    "grpo_passk": grpo_passk,
}


def compute_advantages(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_size: int,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    reward_baselines: torch.Tensor | None = None,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns, float32 ``(N, T)`` and 0 outside ``response_mask``, no gradient.

    ``token_level_rewards (N, T)`` holds the scalar reward on each sequence's last response
    token (and any per-token terms, e.g. ``-beta * kl``); ``response_mask (N, T)`` is 1 on the
    tokens the model generated. Rows come group by group, ``group_size`` consecutive rows per
    prompt. ``values (N, T)`` are needed by ``gae``, ``reward_baselines (N,)`` by ``remax``;
    ``gamma`` discounts reinforce_plus_plus, remax and gae, ``lam`` is GAE's lambda;
    ``norm_adv_by_std`` applies to grpo and grpo_passk; ``eps`` is added to group stds.
    """
    fn = ADVANTAGE_ESTIMATORS.get(name)
    if fn is None:
        raise ValueError(
            f"unknown advantage estimator {name!r}; expected one of {tuple(ADVANTAGE_ESTIMATORS)}"
        )
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be (N, T), got shape {tuple(token_level_rewards.shape)}"
        )
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != token_level_rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    params = AdvantageParams(
        group_size=group_size,
        values=values,
        gamma=gamma,
        lam=lam,
        reward_baselines=reward_baselines,
        norm_adv_by_std=norm_adv_by_std,
        eps=eps,
    )
    with torch.no_grad():
        return fn(token_level_rewards.detach(), response_mask, params)
