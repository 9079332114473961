"""Inputs shared by the advantage estimators, and the group / token plumbing they all use.

Every estimator takes ``token_level_rewards (N, T)`` (the scalar reward on the last response
token, possibly per-token terms such as a KL penalty elsewhere), the 0/1 ``response_mask
(N, T)`` and an ``AdvantageParams``; it returns ``(advantages, returns)``, both ``(N, T)`` and 0
outside the mask, in float32 (float64 if the rewards are float64). Rows come group by group:
``group_size`` consecutive rows are the samples of one prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.masked import masked_sum
from kernels.precision import at_least_float32


@dataclass(frozen=True)
class AdvantageParams:
    """Settings of ``compute_advantages``; each estimator reads the ones it needs. The
    estimator's options are its config row's fields under the same names (verl's)."""

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
    norm_adv_by_std_in_grpo: bool = True
    """grpo, grpo_passk and gdpo: divide by the group's std (verl's name)."""
    eps: float | None = None
    """Added to the group std before dividing (None: verl's 1e-6), or to the denominator of the
    optimal token baselines (None: verl's 1e-8)."""
    f_norm: float = 1.0
    """gpg: the advantage is divided by it (verl ``f_norm``)."""
    old_logprobs: torch.Tensor | None = None
    """optimal_token_baseline(s): ``(N, T)`` log-probs of the sampled tokens under pi_old."""
    sum_pi_squared: torch.Tensor | None = None
    """optimal_token_baseline(s): ``(N, T)`` sum over the vocabulary of pi_old(v)**2 per token."""
    is_weights: torch.Tensor | None = None
    """optimal_token_baseline(s): ``(N, T)`` rollout IS weights; W is scaled by their square."""
    handle_zero_tail: bool = True
    """optimal_token_baseline(s): baseline 0 past the second-longest sample of a group (verl)."""
    reward_components: torch.Tensor | None = None
    """gdpo: ``(K, N)`` the K reward components of each sample (None: the one total reward)."""
    gdpo_reward_weights: Sequence[float] | None = None
    """gdpo: weight of each of the K components in the sum (None or empty: all 1)."""

    def eps_or(self, default: float) -> float:
        return default if self.eps is None else self.eps


def sequence_scores(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's total reward over its response tokens, float32 ``(N,)``.

    verl sums the whole row; summing only masked tokens is the same for well-formed input and
    keeps garbage in padding out.
    """
    return masked_sum(at_least_float32(token_level_rewards), mask, dim=-1)


def grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(N,)`` viewed as ``(G, n)``, one row per prompt; N must be a multiple of n."""
    if x.numel() % group_size:
        raise ValueError(f"batch has {x.numel()} rows, not a multiple of group_size {group_size}")
    return x.view(-1, group_size)


def to_tokens(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast ``(N,)`` over each sequence's response tokens; 0 elsewhere. ``(N, T)``"""
    expanded = at_least_float32(per_sequence)[:, None].expand(mask.shape)
    return torch.where(mask.bool(), expanded, torch.zeros_like(expanded))


def on_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` on the masked tokens, 0 elsewhere (``torch.where``, so NaN there is dropped)."""
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def constant_groups(scores: torch.Tensor) -> torch.Tensor:
    """``(G, 1)`` True where every sample of the group got the same score.

    Such a group carries no learning signal and its advantages must be exactly 0. Computing
    ``r - mean`` does not give that when the reward is not representable: the float32 mean of
    six rewards of 0.3 differs from 0.3 by ~1e-8, and GRPO then divides that by a std of the
    same size (verl gives each sample +0.029).
    """
    return (scores == scores[:, :1]).all(-1, keepdim=True)


def centred(scores: torch.Tensor) -> torch.Tensor:
    """``r - mean_g`` for scores ``(G, n)``, exactly 0 in constant groups; a group of one is
    left as is (mean 0, verl)."""
    if scores.shape[-1] == 1:
        return scores
    out = scores - scores.mean(-1, keepdim=True)
    return torch.where(constant_groups(scores), torch.zeros_like(out), out)
