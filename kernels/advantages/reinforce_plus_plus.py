"""REINFORCE++ (Hu 2025): batch-whitened returns, without or with a group baseline."""

from __future__ import annotations

import torch

from kernels.advantages._common import (
    AdvantageParams,
    centred,
    grouped,
    on_mask,
    sequence_scores,
    to_tokens,
)
from kernels.advantages.returns import discounted_cumsum
from kernels.masked import masked_whiten
from kernels.precision import at_least_float32


def reinforce_plus_plus(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``reinforce_plus_plus``: discounted return-to-go, whitened over the batch.

    ``G_t = r_t + gamma * G_{t+1}`` over each sequence's response tokens (it restarts with
    every sequence; per-token terms such as a KL penalty accumulate with the final reward).
    The advantages are ``G`` whitened with verl's ``masked_whiten``: mean and unbiased variance
    pooled over every response token of the batch. Returns are ``G``.

    Positions outside the mask (tool tokens inside a multi-turn response, padding) are skipped:
    the running return is carried through them unchanged and a reward placed there is
    dropped, as verl 0.9.1 does (see ``returns``).
    """
    returns = discounted_cumsum(at_least_float32(token_level_rewards), response_mask, params.gamma)
    adv = on_mask(masked_whiten(returns, response_mask), response_mask)  # (N, T)
    return adv, returns


def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``reinforce_plus_plus_baseline``: ``r - mean_g`` on every response token, then
    whitened over the batch's response tokens (so longer sequences weigh more in the
    statistics). A group of one has mean 0; a group whose rewards are all equal is centred to
    exactly 0 (see ``grpo_advantages``). Returns equal the advantages (verl).
    """
    scores = grouped(sequence_scores(token_level_rewards, response_mask), params.group_size)
    tokens = to_tokens(centred(scores).reshape(-1), response_mask)  # (N, T)
    adv = on_mask(masked_whiten(tokens, response_mask), response_mask)  # (N, T)
    return adv, adv
