"""GAE (Schulman et al. 2016) from a critic's values, for PPO with a value head."""

from __future__ import annotations

import torch

from kernels.advantages._common import AdvantageParams, on_mask
from kernels.advantages.returns import discounted_cumsum, next_masked
from kernels.masked import masked_whiten
from kernels.precision import at_least_float32


def gae(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``gae``: ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``.

    Both recurrences run over each sequence's response tokens only: ``t+1`` is the next
    response token (tool tokens are skipped, as verl does), and ``V`` past the last response
    token is 0, the episode having ended. Returns are ``A + V`` (the critic's targets), taken
    before the advantages are whitened with verl's ``masked_whiten`` over the batch's response
    tokens. Needs ``params.values`` ``(N, T)``.
    """
    values = params.values
    if values is None:
        raise ValueError("gae needs values (N, T) from a critic; got None")
    if values.shape != response_mask.shape:
        raise ValueError(
            f"values shape {tuple(values.shape)} != response_mask shape {tuple(response_mask.shape)}"
        )
    v = on_mask(at_least_float32(values.detach()), response_mask)  # (N, T)
    r = on_mask(at_least_float32(token_level_rewards), response_mask)  # (N, T)
    delta = r + params.gamma * next_masked(v, response_mask) - v  # (N, T)
    adv = discounted_cumsum(delta, response_mask, params.gamma * params.lam)  # (N, T)
    returns = on_mask(adv + v, response_mask)  # (N, T)
    adv = on_mask(masked_whiten(adv, response_mask), response_mask)  # (N, T)
    return adv, returns
