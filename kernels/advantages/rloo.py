"""RLOO: each sample's baseline is the mean reward of the other samples of its prompt."""

from __future__ import annotations

import torch

from kernels.advantages._common import (
    AdvantageParams,
    centred,
    grouped,
    sequence_scores,
    to_tokens,
)


def rloo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``rloo``: ``A_i = r_i - mean_{j != i} r_j = (r_i - mean_g) * n / (n - 1)``.

    A group of one has no other sample: its advantage is its reward (verl leaves it
    unchanged). A group whose rewards are all equal gets exactly 0 (see ``grpo_advantages``).
    Returns equal the advantages.
    """
    scores = grouped(sequence_scores(token_level_rewards, response_mask), params.group_size)
    n = params.group_size  # (G, n) scores
    if n > 1:
        scores = centred(scores) * (n / (n - 1))  # (G, n)
    adv = to_tokens(scores.reshape(-1), response_mask)  # (N, T)
    return adv, adv
