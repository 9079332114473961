"""GRPO for pass@k (Chen et al. 2025): credit only the best sample of each group."""

from __future__ import annotations

import torch

from kernels.advantages._common import AdvantageParams, grouped, sequence_scores, to_tokens
from kernels.advantages.grpo import GRPO_EPS


def grpo_passk(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``grpo_passk``: the best sample gets ``r_max - r_second``, every other sample 0.

    With ``norm_adv_by_std_in_grpo`` (the default, as in verl) that difference is divided by the
    group's unbiased std ``+ eps``; ``norm_adv_by_std_in_grpo=False`` gives the bare difference. On a
    tie for the best the first sample is credited, with 0 (the difference is 0). Needs groups
    of at least two. Returns equal the advantages.
    """
    if params.group_size < 2:
        raise ValueError(f"grpo_passk needs group_size >= 2, got {params.group_size}")
    scores = grouped(sequence_scores(token_level_rewards, response_mask), params.group_size)
    top2 = scores.topk(2, dim=-1).values  # (G, 2)
    gap = top2[:, 0] - top2[:, 1]  # (G,)
    if params.norm_adv_by_std_in_grpo:
        gap = gap / (scores.std(-1) + params.eps_or(GRPO_EPS))
    best = scores.argmax(-1)  # (G,) first index of the maximum
    adv = torch.zeros_like(scores).scatter(1, best[:, None], gap[:, None])  # (G, n)
    adv = to_tokens(adv.reshape(-1), response_mask)  # (N, T)
    return adv, adv
