"""OPO: a length-weighted group baseline, optimal for sequence-level rewards."""

from __future__ import annotations

import torch

from kernels.advantages._common import AdvantageParams, grouped, sequence_scores, to_tokens


def opo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``opo``: ``A_i = r_i - sum_g(len_j * r_j) / sum_g(len_j)``, len = response tokens.

    Longer samples weigh more in the baseline. A group of one, or a group without any response
    token, gets baseline 0 (verl). Returns equal the advantages.
    """
    scores = grouped(sequence_scores(token_level_rewards, response_mask), params.group_size)
    lengths = grouped(response_mask.bool().sum(-1).float(), params.group_size)  # (G, n)
    total = lengths.sum(-1, keepdim=True)  # (G, 1)
    baseline = (lengths * scores).sum(-1, keepdim=True) / total.clamp_min(1)  # (G, 1)
    if params.group_size == 1:
        baseline = torch.zeros_like(baseline)
    adv = to_tokens((scores - baseline).reshape(-1), response_mask)  # (N, T)
    return adv, adv
