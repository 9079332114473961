"""OPO: a length-weighted group baseline, optimal for sequence-level rewards."""

from __future__ import annotations

import torch

from kernels.advantages._common import (
    AdvantageParams,
    constant_groups,
    grouped,
    sequence_scores,
    to_tokens,
)


def opo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``opo``: ``A_i = r_i - sum_g(len_j * r_j) / sum_g(len_j)``, len = response tokens.

    Longer samples weigh more in the baseline. A group of one gets baseline 0 (verl). A group
    without any response token gets baseline 0 too, where verl divides 0 by 0 and gives NaN
    (a deliberate difference). A group whose rewards are all equal gets exactly 0 (see
    ``grpo_advantages``). Returns equal the advantages.
    """
    scores = grouped(sequence_scores(token_level_rewards, response_mask), params.group_size)
    lengths = grouped(response_mask.bool().sum(-1).to(scores.dtype), params.group_size)  # (G, n)
    total = lengths.sum(-1, keepdim=True)  # (G, 1)
    baseline = (lengths * scores).sum(-1, keepdim=True) / total.clamp_min(1)  # (G, 1)
    adv = scores - baseline  # (G, n)
    if params.group_size == 1:
        adv = scores
    else:
        adv = torch.where(constant_groups(scores), torch.zeros_like(adv), adv)
    adv = to_tokens(adv.reshape(-1), response_mask)  # (N, T)
    return adv, adv
