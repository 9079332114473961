"""Advantage estimators, behind one call: ``compute_advantages(row, ...)``, ``row`` the
estimator's row of the config (``algorithm.adv_estimator``), which loads its function and holds
its options and traits.

One module per estimator family, each a function ``(token_level_rewards (N, T), response_mask
(N, T), AdvantageParams) -> (advantages, returns)``, imported by its row when that estimator is
chosen. Group-scalar estimators (grpo, dr_grpo, rloo, opo, grpo_passk, gpg, gdpo,
reinforce_plus_plus_baseline) score each sequence by its total reward over its response tokens
and broadcast one advantage over those tokens; reinforce_plus_plus, remax, gae and the optimal
token baselines work per token. The whitening of reinforce_plus_plus(_baseline), gdpo and gae
is verl's ``masked_whiten`` (``kernels.masked``): mean and Bessel-corrected variance pooled
over all response tokens of the batch, ``(x - mean) / sqrt(var + 1e-8)``.

Every estimator is checked against verl 0.9.1 by ``tests/test_verl_parity.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from kernels.advantages._common import AdvantageParams
from kernels.advantages.unequal import by_group, group_sizes

__all__ = ["AdvantageFn", "EstimatorRow", "compute_advantages"]

AdvantageFn = Callable[
    [torch.Tensor, torch.Tensor, AdvantageParams], tuple[torch.Tensor, torch.Tensor]
]


class EstimatorRow(Protocol):
    """What this kernel needs of an estimator's row (``actors/runtime/config/estimators.py``,
    the one registry of the estimators): its name, its function, its options (fields of
    ``AdvantageParams`` under their names) and how it takes groups of unequal size."""

    @property
    def name(self) -> str: ...

    @property
    def grouped(self) -> bool: ...  # uses the group (else each row alone)

    @property
    def unequal_groups(self) -> bool: ...  # takes groups of unequal size, group by group

    def load(self) -> AdvantageFn: ...

    def kernel_options(self) -> dict[str, Any]: ...


def compute_advantages(
    estimator: EstimatorRow,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_size: int | Sequence[int],
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    eps: float | None = None,
    f_norm: float = 1.0,
    old_logprobs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    reward_components: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ``(N, T)`` of the row ``estimator`` (its function, called with
    the row's options: ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``, ...; a user's own
    estimator for ``algorithm.adv_estimator = {name = "custom", ...}``), 0 outside
    ``response_mask``, no gradient; float32 (float64 when the rewards are float64).

    ``token_level_rewards (N, T)`` holds the scalar reward on each sequence's last response
    token (and any per-token terms, e.g. ``-beta * kl``); ``response_mask (N, T)`` is 1 on the
    tokens the model generated. Rows come group by group, ``group_size`` consecutive rows per
    prompt; a sequence of sizes gives groups of unequal size, one count per group (verl's
    ``index`` with any count per uid): the estimators whose rows say ``unequal_groups`` take
    them (``kernels/advantages/unequal.py``), the others raise. Per estimator:

    - ``gae`` needs ``values (N, T)``; ``remax`` needs ``reward_baselines (N,)``.
    - ``eps`` is added to the group stds of grpo, grpo_passk and gdpo (default 1e-6) or to the
      optimal token baselines' denominator (default 1e-8).
    - ``gpg`` divides by ``f_norm`` (verl default 1.0).
    - ``optimal_token_baseline`` / ``tir_optimal_token_baseline`` need ``old_logprobs`` and
      ``sum_pi_squared`` ``(N, T)`` (the sum over the vocabulary of pi_old**2 at each token),
      optionally ``is_weights (N, T)`` (rollout IS weights) and ``handle_zero_tail``.
    - ``gdpo`` takes ``reward_components (K, N)`` (one row per ``gdpo_reward_weights``);
      without them it uses the one total reward.

    A ``custom`` row's function gets the same rewards, mask and ``AdvantageParams``, and groups
    of equal size.
    """
    fn = estimator.load()
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be (N, T), got shape {tuple(token_level_rewards.shape)}"
        )
    if response_mask.shape != token_level_rewards.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != token_level_rewards shape "
            f"{tuple(token_level_rewards.shape)}"
        )
    sizes = None
    if not isinstance(group_size, int):
        sizes = group_sizes(group_size, token_level_rewards.shape[0])
        if len(set(sizes)) == 1:
            group_size, sizes = sizes[0], None
        else:
            group_size = 1
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    params = AdvantageParams(
        group_size=group_size,
        values=values,
        reward_baselines=reward_baselines,
        eps=eps,
        f_norm=f_norm,
        old_logprobs=None if old_logprobs is None else old_logprobs.detach(),
        sum_pi_squared=None if sum_pi_squared is None else sum_pi_squared.detach(),
        is_weights=None if is_weights is None else is_weights.detach(),
        handle_zero_tail=handle_zero_tail,
        reward_components=reward_components,
        **estimator.kernel_options(),
    )
    if not 0.0 <= params.gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {params.gamma}")
    if not 0.0 <= params.lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {params.lam}")
    if eps is not None and not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not f_norm > 0.0:
        raise ValueError(f"f_norm must be > 0, got {f_norm}")
    with torch.no_grad():
        if sizes is not None:
            return by_group(estimator, fn, token_level_rewards.detach(), response_mask, params,
                            sizes)
        return fn(token_level_rewards.detach(), response_mask, params)
