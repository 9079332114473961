"""ReMax (Li et al. 2023): the reward of a greedy sample of the same prompt as baseline."""

from __future__ import annotations

import torch

from kernels.advantages._common import AdvantageParams, to_tokens
from kernels.advantages.returns import discounted_cumsum
from kernels.precision import at_least_float32


def remax(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``remax``: return-to-go minus ``reward_baselines`` ``(N,)``, no whitening.

    The baseline of each row is the reward of a greedy (argmax) completion of its prompt,
    which the caller generates and scores. Returns are the return-to-go, discounted by
    ``gamma`` (verl does not discount; the default ``gamma = 1`` matches it).
    """
    baselines = params.reward_baselines
    if baselines is None:
        raise ValueError(
            "remax needs reward_baselines (N,), the rewards of greedy samples; got None"
        )
    if baselines.shape != response_mask.shape[:1]:
        raise ValueError(
            f"reward_baselines shape {tuple(baselines.shape)} != ({response_mask.shape[0]},)"
        )
    returns = discounted_cumsum(at_least_float32(token_level_rewards), response_mask, params.gamma)
    adv = returns - to_tokens(baselines, response_mask)  # (N, T), 0 outside the mask
    return adv, returns
