"""Optimal token baselines (verl ``optimal_token_baseline``, ``tir_optimal_token_baseline``).

Instead of one baseline per sample, every token position gets its own baseline, the
variance-weighted mean of the group's returns at that position:
``B_t = sum_i G_it * W_it / (sum_i W_it + eps)``. ``W_it = sum_{j <= t} w_ij`` is a cumulative
path-variance proxy with ``w_j = 1 - 2 * pi_j + sum_v pi(v)**2`` (the squared norm of the
score function of a softmax at the sampled token), scaled by the square of the rollout IS
weight when one is given. ``G_it`` is the return-to-go. Advantages are ``G - B`` on the
response tokens, not whitened; returns are ``G``.
"""

from __future__ import annotations

import torch

from kernels.advantages._common import AdvantageParams, grouped, on_mask
from kernels.precision import at_least_float32

OTB_EPS = 1e-8  # verl's ``epsilon`` of the optimal token baselines


def _inputs(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return-to-go ``G``, cumulative ``W`` and the float mask, all ``(N, T)``."""
    if params.old_logprobs is None or params.sum_pi_squared is None:
        raise ValueError(
            "the optimal token baselines need old_logprobs (N, T) and sum_pi_squared (N, T)"
        )
    for label, t in (("old_logprobs", params.old_logprobs),
                     ("sum_pi_squared", params.sum_pi_squared), ("is_weights", params.is_weights)):
        if t is not None and t.shape != response_mask.shape:
            raise ValueError(
                f"{label} shape {tuple(t.shape)} != response_mask shape "
                f"{tuple(response_mask.shape)}"
            )
    rewards = on_mask(at_least_float32(token_level_rewards), response_mask)  # (N, T)
    m = response_mask.to(rewards.dtype)  # (N, T)
    # Positions outside the mask carry the return of the tokens after them (verl).
    returns = rewards.flip(-1).cumsum(-1).flip(-1)  # (N, T)
    w = 1.0 - 2.0 * torch.exp(at_least_float32(params.old_logprobs)) + params.sum_pi_squared
    if params.is_weights is not None:
        w = w * params.is_weights.square()
    w_cum = on_mask(w.to(rewards.dtype), response_mask).cumsum(-1)  # (N, T)
    return returns, w_cum, m


def _zero_tail(baselines: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``baselines (G, n, L)`` with 0 from the second-longest length on for the longest sample
    of each group ``lengths (G, n)``, when it is the only one that long (nothing there to
    compare it with). Positions are indices into the last dim."""
    ordered = lengths.sort(-1).values  # (G, n)
    longest, second = ordered[:, -1:], ordered[:, -2:-1]  # (G, 1) each
    unique = ((lengths == longest).sum(-1, keepdim=True) == 1) & (longest > second)  # (G, 1)
    target = unique & (lengths == longest)  # (G, n)
    positions = torch.arange(baselines.shape[-1], device=baselines.device)  # (L,)
    tail = target[..., None] & (positions >= second[..., None])  # (G, n, L)
    return torch.where(tail, torch.zeros_like(baselines), baselines)


def _group_baselines(
    returns: torch.Tensor, w_cum: torch.Tensor, valid: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """``B_t = sum_i G_it W_it / (sum_i W_it + eps)`` over each group, ``(G, n, L)``.

    ``valid (N, L)`` selects the positions that count; rows come group by group."""
    n = group_size
    if returns.shape[0] % n:
        raise ValueError(f"batch has {returns.shape[0]} rows, not a multiple of group_size {n}")
    shape = (-1, n, returns.shape[-1])
    g_ret, g_w, g_m = returns.view(shape), w_cum.view(shape), valid.view(shape)  # (G, n, L)
    numerator = (g_ret * g_w * g_m).sum(1, keepdim=True)  # (G, 1, L)
    denominator = (g_w * g_m).sum(1, keepdim=True) + eps  # (G, 1, L)
    return (numerator / denominator).expand(g_ret.shape)  # (G, n, L)


def optimal_token_baseline(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``optimal_token_baseline``: a baseline per absolute token position of each group.

    Needs ``params.old_logprobs`` and ``params.sum_pi_squared`` ``(N, T)``; ``is_weights``
    (verl's ``rollout_is_weights``) is optional. A group of one gets baseline 0 (its
    advantages are its returns). With ``handle_zero_tail`` (verl's default) the longest sample
    of a group, when it is the only one of its length, gets baseline 0 from column ``L2`` on,
    ``L2`` being the second-longest sample's token count (verl compares that count with
    column indices, which differ from it when masks have holes). ``eps`` defaults to 1e-8.
    """
    returns, w_cum, m = _inputs(token_level_rewards, response_mask, params)
    n = params.group_size
    baselines = _group_baselines(returns, w_cum, m, n, params.eps_or(OTB_EPS))  # (G, n, T)
    if n == 1:
        baselines = torch.zeros_like(baselines)
    elif params.handle_zero_tail:
        baselines = _zero_tail(baselines, m.sum(-1).view(-1, n))
    adv = (returns - baselines.reshape(returns.shape)) * m  # (N, T)
    return adv, returns * m


def tir_optimal_token_baseline(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl ``tir_optimal_token_baseline``: the optimal token baseline over each sample's k-th
    response token rather than its k-th column, for multi-turn (tool-integrated) responses.

    Each row's response tokens are packed to the left (tool tokens between turns dropped), the
    baseline is computed per packed position across the group, and the advantages are put back
    on the response tokens. Rows without a response token are left out of their group: a group
    with a single non-empty row gets baseline 0. ``handle_zero_tail`` works on packed
    positions. Inputs, returns and ``eps`` as ``optimal_token_baseline``.
    """
    returns, w_cum, m = _inputs(token_level_rewards, response_mask, params)
    n = params.group_size
    keep = response_mask.bool()  # (N, T)
    lengths = keep.sum(-1)  # (N,)
    width = int(lengths.max()) if lengths.numel() else 0
    # Packed index of every response token; other positions go to a spill column, dropped.
    packed_at = torch.where(keep, keep.cumsum(-1) - 1, torch.full_like(lengths[:, None], width))

    def pack(x: torch.Tensor) -> torch.Tensor:  # (N, T) -> (N, width)
        out = torch.zeros(x.shape[0], width + 1, dtype=x.dtype, device=x.device)
        return out.scatter(1, packed_at, on_mask(x, keep))[:, :width]

    packed_ret, packed_w = pack(returns), pack(w_cum)  # (N, width)
    positions = torch.arange(width, device=m.device)
    valid = (positions < lengths[:, None]).to(m.dtype)  # (N, width)
    baselines = _group_baselines(packed_ret, packed_w, valid, n, params.eps_or(OTB_EPS))
    members = grouped((lengths > 0).to(m.dtype), n).sum(-1)  # (G,) non-empty rows per group
    baselines = torch.where((members <= 1)[:, None, None], torch.zeros_like(baselines), baselines)
    if params.handle_zero_tail and n > 1:
        group_lengths = grouped(lengths.to(m.dtype), n)  # (G, n)
        trimmed = _zero_tail(baselines, group_lengths)
        baselines = torch.where((members >= 2)[:, None, None], trimmed, baselines)
    packed_adv = packed_ret - baselines.reshape(packed_ret.shape)  # (N, width)
    spill = torch.cat([packed_adv, torch.zeros_like(packed_adv[:, :1])], dim=1)
    adv = on_mask(spill.gather(1, packed_at), keep)  # (N, T)
    return adv, returns * m
