"""Group-relative advantages (GRPO and Dr.GRPO).

Rewards arrive flat, group by group: the ``n`` samples of one prompt are consecutive. Each
sample gets one scalar advantage, broadcast over that sample's response tokens.
"""

from __future__ import annotations

import torch

from kernels.advantages._common import AdvantageParams, sequence_scores, to_tokens


def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages ``(r - mean_g) / (std_g + eps)`` for rewards ``(G*n,)``, returned ``(G*n,)``.

    ``std_g`` is the unbiased standard deviation (``torch.std``), as in verl. A group of one has
    no spread to normalise by, so it gets mean 0 and std 1 (verl's convention): its advantage
    is ``r / (1 + eps)``, i.e. the reward itself up to ``eps``. A group whose rewards are all
    equal gets zeros. With ``norm_by_std=False`` the result is Dr.GRPO's ``r - mean_g``.
    The result is float32.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (G*n,), got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size {group_size}"
        )
    scores = rewards.float().view(-1, group_size)  # (G, n)
    if group_size == 1:
        mean = torch.zeros_like(scores)  # (G, 1)
        std = torch.ones_like(scores)  # (G, 1)
    else:
        mean = scores.mean(dim=-1, keepdim=True)  # (G, 1)
        std = scores.std(dim=-1, keepdim=True)  # (G, 1), unbiased
    adv = scores - mean  # (G, n)
    if norm_by_std:
        adv = adv / (std + eps)
    return adv.reshape(-1)  # (G*n,)


def grpo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``grpo``: ``grpo_advantages`` of each sequence's total reward, on its tokens.

    ``params.norm_adv_by_std=False`` gives Dr.GRPO. Returns equal the advantages (verl).
    """
    scores = sequence_scores(token_level_rewards, response_mask)  # (N,)
    adv = grpo_advantages(
        scores, params.group_size, norm_by_std=params.norm_adv_by_std, eps=params.eps
    )  # (N,)
    adv = to_tokens(adv, response_mask)  # (N, T)
    return adv, adv


def dr_grpo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: ``r - mean_g`` whatever ``norm_adv_by_std`` says (verl: grpo with
    ``norm_adv_by_std_in_grpo=False``)."""
    scores = sequence_scores(token_level_rewards, response_mask)  # (N,)
    adv = grpo_advantages(scores, params.group_size, norm_by_std=False)  # (N,)
    adv = to_tokens(adv, response_mask)  # (N, T)
    return adv, adv
