"""Group-relative advantages (GRPO, Dr.GRPO, and GRPO scaled by the batch's std).

Rewards arrive flat, group by group: the ``n`` samples of one prompt are consecutive. Each
sample gets one scalar advantage, broadcast over that sample's response tokens.
"""

from __future__ import annotations

import torch

from kernels.advantages._common import (
    AdvantageParams,
    constant_groups,
    grouped,
    sequence_scores,
    to_tokens,
)
from kernels.precision import at_least_float32

GRPO_EPS = 1e-6  # verl's ``epsilon`` of compute_grpo_outcome_advantage
BATCH_STD_EPS = 1e-4  # TRL's, added to the batch's std (GRPOTrainer, scale_rewards = "batch")


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    norm_by_std: bool = True,
    eps: float = GRPO_EPS,
) -> torch.Tensor:
    """GRPO advantages ``(r - mean_g) / (std_g + eps)`` for rewards ``(G*n,)``, returned ``(G*n,)``.

    ``std_g`` is the unbiased standard deviation (``torch.std``), as in verl. A group of one has
    no spread to normalise by, so it gets mean 0 and std 1 (verl's convention): its advantage
    is ``r / (1 + eps)``, i.e. the reward itself up to ``eps``. With ``norm_by_std=False`` the
    result is Dr.GRPO's ``r - mean_g``. The result is float32 (float64 for float64 rewards).

    A group of two or more whose rewards are all equal gets exactly 0. This is a deliberate
    difference from verl: verl computes ``r - mean`` and ``std`` in the rewards' dtype, and for
    a reward that float32 cannot represent (six rewards of 0.3) both are ~1e-8, so every sample
    gets ``1e-8 / (1e-8 + 1e-6)``, about +0.029. In float64 verl's value is below 1e-10.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (G*n,), got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size {group_size}"
        )
    scores = at_least_float32(rewards).view(-1, group_size)  # (G, n)
    if group_size == 1:
        mean = torch.zeros_like(scores)  # (G, 1)
        std = torch.ones_like(scores)  # (G, 1)
    else:
        mean = scores.mean(dim=-1, keepdim=True)  # (G, 1)
        std = scores.std(dim=-1, keepdim=True)  # (G, 1), unbiased
    adv = scores - mean  # (G, n)
    if norm_by_std:
        adv = adv / (std + eps)
    if group_size > 1:
        adv = torch.where(constant_groups(scores), torch.zeros_like(adv), adv)
    return adv.reshape(-1)  # (G*n,)


def grpo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``grpo``: ``grpo_advantages`` of each sequence's total reward, on its tokens.

    ``params.norm_adv_by_std_in_grpo=False`` gives Dr.GRPO. Returns equal the advantages (verl).
    """
    scores = sequence_scores(token_level_rewards, response_mask)  # (N,)
    adv = grpo_advantages(
        scores, params.group_size, norm_by_std=params.norm_adv_by_std_in_grpo,
        eps=params.eps_or(GRPO_EPS),
    )  # (N,)
    adv = to_tokens(adv, response_mask)  # (N, T)
    return adv, adv


def dr_grpo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: ``r - mean_g`` whatever ``norm_adv_by_std_in_grpo`` says (verl: grpo with
    ``norm_adv_by_std_in_grpo=False``)."""
    scores = sequence_scores(token_level_rewards, response_mask)  # (N,)
    adv = grpo_advantages(scores, params.group_size, norm_by_std=False)  # (N,)
    adv = to_tokens(adv, response_mask)  # (N, T)
    return adv, adv


def grpo_batch_std(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's GRPO with ``scale_rewards = "batch"`` (Lite PPO's normalisation):
    ``(r - mean_g) / (std_batch + eps)``, each sequence's total reward against its group's
    mean, divided by the unbiased std of every reward of the batch instead of its group's, so a
    group whose rewards barely differ is not blown up to unit scale. ``eps`` defaults to TRL's
    1e-4; a batch of one row has std 0, as in TRL.

    A constant group gets exactly 0, as in grpo (TRL computes ``r - mean`` in the rewards'
    dtype, so six float32 rewards of 0.3 give it ~1e-8 / std). Returns equal the advantages.
    """
    scores = sequence_scores(token_level_rewards, response_mask)  # (N,)
    groups = grouped(scores, params.group_size)  # (G, n)
    centred = groups - groups.mean(dim=-1, keepdim=True)  # (G, n)
    centred = torch.where(constant_groups(groups), torch.zeros_like(centred), centred)
    std = scores.std() if scores.numel() > 1 else scores.new_zeros(())  # (), unbiased
    adv = (centred / (std + params.eps_or(BATCH_STD_EPS))).reshape(-1)  # (N,)
    adv = to_tokens(adv, response_mask)  # (N, T)
    return adv, adv
