"""GPG (Chu et al. 2025): group-centred rewards rescaled by the share of rewarded samples."""

from __future__ import annotations

import torch

from kernels.advantages._common import (
    AdvantageParams,
    centred,
    grouped,
    sequence_scores,
    to_tokens,
)


def gpg(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``gpg``: ``A_i = alpha * (r_i - mean_g) / f_norm`` with ``alpha = N / M``.

    ``N`` is the number of samples in the batch and ``M`` the number whose total reward is not
    zero (at least 1), so a batch where few samples earn a reward gets a larger step; there is
    no division by the group's std. A group of one has mean 0 (its advantage is
    ``alpha * r / f_norm``); a group whose rewards are all equal gets exactly 0 (see
    ``grpo_advantages``). ``f_norm`` is ``params.f_norm`` (verl's default 1.0). Returns equal
    the advantages.
    """
    flat = sequence_scores(token_level_rewards, response_mask)  # (N,)
    rewarded = torch.count_nonzero(flat).clamp(min=1)
    alpha = flat.numel() / rewarded
    scores = centred(grouped(flat, params.group_size))  # (G, n)
    adv = to_tokens((alpha * scores / params.f_norm).reshape(-1), response_mask)  # (N, T)
    return adv, adv
