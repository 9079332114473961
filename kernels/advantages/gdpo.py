"""GDPO (group reward-decoupled normalisation): GRPO per reward component, then summed."""

from __future__ import annotations

import torch

from kernels.advantages._common import AdvantageParams, on_mask, sequence_scores, to_tokens
from kernels.advantages.grpo import GRPO_EPS, grpo_advantages
from kernels.masked import masked_whiten
from kernels.precision import at_least_float32


def gdpo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``gdpo``: ``A = whiten(sum_k w_k * grpo(r_k))`` over the batch's response tokens.

    Each of the K reward components (``params.reward_components (K, N)``, e.g. a format reward
    and an accuracy reward; verl reads them from ``algorithm.gdpo_reward_keys``) is normalised
    within its group by ``grpo_advantages`` on its own, so a component with a large scale does
    not drown the others; the per-sample results are summed with ``params.gdpo_reward_weights``
    (verl ``gdpo_reward_weights``, default all 1), broadcast over the response tokens and
    whitened with verl's ``masked_whiten``. Without components the one total reward is used
    (GRPO followed by whitening, as verl does). ``norm_adv_by_std_in_grpo`` and ``eps`` apply to every
    component. Returns equal the advantages.
    """
    components = params.reward_components
    if components is None:
        components = sequence_scores(token_level_rewards, response_mask)[None]  # (1, N)
    n_rows = response_mask.shape[0]
    if components.dim() != 2 or components.shape[1] != n_rows:
        raise ValueError(
            f"gdpo reward_components must be (K, {n_rows}), got {tuple(components.shape)}"
        )
    components = at_least_float32(components)
    weights = params.gdpo_reward_weights or None
    if weights is None:
        weights = (1.0,) * components.shape[0]
    if len(weights) != components.shape[0]:
        raise ValueError(
            f"gdpo has {components.shape[0]} reward components but {len(weights)} weights"
        )
    total = torch.zeros(n_rows, dtype=components.dtype, device=components.device)  # (N,)
    for weight, scores in zip(weights, components, strict=True):
        total = total + weight * grpo_advantages(
            scores, params.group_size, norm_by_std=params.norm_adv_by_std_in_grpo,
            eps=params.eps_or(GRPO_EPS),
        )
    adv = on_mask(masked_whiten(to_tokens(total, response_mask), response_mask), response_mask)
    return adv, adv
