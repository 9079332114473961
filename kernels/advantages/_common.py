"""Inputs shared by the advantage estimators, and the group / token plumbing they all use.

Every estimator takes ``token_level_rewards (N, T)`` (the scalar reward on the last response
token, possibly per-token terms such as a KL penalty elsewhere), the 0/1 ``response_mask
(N, T)`` and an ``AdvantageParams``; it returns float32 ``(advantages, returns)``, both
``(N, T)`` and 0 outside the mask. Rows come group by group: ``group_size`` consecutive rows
are the samples of one prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.masked import masked_sum


@dataclass(frozen=True)
class AdvantageParams:
    """Settings of ``compute_advantages``; each estimator reads the ones it needs."""

    group_size: int
    """Samples per prompt (verl ``rollout.n``); consecutive rows form a group."""
    values: torch.Tensor | None = None
    """gae: the critic's values ``(N, T)`` at the response tokens."""
    gamma: float = 1.0
    """Discount of gae, reinforce_plus_plus and remax."""
    lam: float = 1.0
    """gae: the lambda of GAE."""
    reward_baselines: torch.Tensor | None = None
    """remax: ``(N,)`` reward of a greedy sample of each row's prompt."""
    norm_adv_by_std: bool = True
    """grpo and grpo_passk: divide by the group's std (verl ``norm_adv_by_std_in_grpo``)."""
    eps: float = 1e-6
    """Added to the group std before dividing."""


def sequence_scores(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's total reward over its response tokens, float32 ``(N,)``.

    verl sums the whole row; summing only masked tokens is the same for well-formed input and
    keeps garbage in padding out.
    """
    return masked_sum(token_level_rewards.float(), mask, dim=-1)


def grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(N,)`` viewed as ``(G, n)``, one row per prompt; N must be a multiple of n."""
    if x.numel() % group_size:
        raise ValueError(f"batch has {x.numel()} rows, not a multiple of group_size {group_size}")
    return x.view(-1, group_size)


def to_tokens(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast ``(N,)`` over each sequence's response tokens; 0 elsewhere. ``(N, T)``"""
    expanded = per_sequence.float()[:, None].expand(mask.shape)
    return torch.where(mask.bool(), expanded, torch.zeros_like(expanded))


def on_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` on the masked tokens, 0 elsewhere (``torch.where``, so NaN there is dropped)."""
    return torch.where(mask.bool(), x, torch.zeros_like(x))
