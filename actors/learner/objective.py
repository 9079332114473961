"""The learner's loss for one micro-batch, and the batch-level quantities it needs first.

Everything here composes ``kernels/`` functions; the only state is the models passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.learner.batch import RolloutBatch
from actors.runtime.config import AlgorithmConfig
from kernels.importance import (
    RejectionRule,
    normalize_weights,
    rejection_mask,
    truncated_is_weights,
)
from kernels.kl import kl_estimate
from kernels.lm_head_logprobs import lm_head_logprobs
from kernels.losses import aggregate, policy_loss, value_loss


def response_logprobs(model, batch: RolloutBatch, temperature: float, *,
                      with_entropy: bool = False):
    """Log-probs (N, W-1) of the response tokens, 0 elsewhere; with entropies when asked.

    Hidden states are gathered at response positions before the LM head (the prompt is most of
    each sequence here), and ``kernels.lm_head_logprobs`` walks them in chunks so no float32
    (tokens, V) logits exist at once (a fused Triton kernel on CUDA).
    """
    core = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wrapper
    hidden = core.base_model(input_ids=batch.input_ids,
                             attention_mask=batch.attention_mask).last_hidden_state
    at = batch.response_mask.bool()  # (N, W-1)
    head = core.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("LM heads with a bias are not supported by the log-prob kernels")
    out = lm_head_logprobs(hidden[:, :-1][at], head.weight, batch.input_ids[:, 1:][at],
                           temperature=temperature, with_entropy=with_entropy)  # (R,) each

    def scatter(values: torch.Tensor) -> torch.Tensor:  # (R,) -> (N, W-1), 0 off the response
        return torch.zeros(at.shape, dtype=values.dtype, device=values.device).masked_scatter(at, values)

    if not with_entropy:
        return scatter(out)
    return scatter(out[0]), scatter(out[1])


@dataclass
class Correction:
    """Per-token loss weights and the mask after rejection, for the batch or a micro-batch."""

    weights: torch.Tensor | None  # (N, W-1) detached, None in bypass mode or is_level = none
    keep: torch.Tensor  # (N, W-1) response mask after rejection rules
    metrics: dict[str, float]


def correction(algo: AlgorithmConfig, old: torch.Tensor, behav: torch.Tensor,
               mask: torch.Tensor) -> Correction:
    """Truncated IS weights π_old/μ and rejection masks from proximal and behaviour log-probs."""
    c = algo.correction
    metrics: dict[str, float] = {}
    keep = mask
    if c.rejection:
        rules = [RejectionRule(r.statistic, r.level, r.low, r.high) for r in c.rejection]
        keep, rs_metrics = rejection_mask(old, behav, mask, rules)
        metrics.update(rs_metrics)
    weights = None
    if c.mode == "decoupled" and c.is_level != "none":
        weights, is_metrics = truncated_is_weights(old, behav, keep, cap=c.is_cap, level=c.is_level)
        metrics.update(is_metrics)
        if c.normalize_weights:
            weights = normalize_weights(weights, keep, level=c.is_level)
    return Correction(weights, keep, metrics)


def micro_batch_loss(
    algo: AlgorithmConfig,
    lp: torch.Tensor,  # (B, W-1) with grad
    entropy: torch.Tensor,  # (B, W-1) with grad
    batch: RolloutBatch,
    advantages: torch.Tensor,  # (B, W-1)
    old: torch.Tensor,  # (B, W-1) PPO old log-probs
    corr: Correction,
    ref: torch.Tensor | None,  # (B, W-1) reference log-probs when a KL loss is used
    *,
    token_count: float,
    seq_count: int,
    norm_constant: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """pg_loss + kl_loss_coef·kl_loss − entropy_coeff·entropy, aggregated over the mini-batch."""
    counts = dict(token_count=token_count, seq_count=seq_count, norm_constant=norm_constant)
    mask = corr.keep
    loss, raw = policy_loss(
        algo.policy_loss, lp, old, advantages, mask, clip_low=algo.clip_ratio_low,
        clip_high=algo.clip_ratio_high, dual_clip=algo.clip_ratio_c or None, weights=corr.weights,
        loss_agg_mode=algo.loss_agg_mode, **counts,
    )
    metrics = {k: float(v) for k, v in raw.items()}
    metrics["actor/entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp_min(1))
    if algo.entropy_coeff > 0:
        loss = loss - algo.entropy_coeff * aggregate(entropy, mask, algo.loss_agg_mode, **counts)
    if algo.use_kl_loss:
        assert ref is not None
        kl = kl_estimate(lp, ref, algo.kl_loss_type)  # (B, W-1)
        kl_loss = aggregate(kl, mask, algo.loss_agg_mode, **counts)
        loss = loss + algo.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = float((kl.detach() * mask).sum() / mask.sum().clamp_min(1))
    return loss, metrics


def critic_loss(algo: AlgorithmConfig, values: torch.Tensor, old_values: torch.Tensor,
                returns: torch.Tensor, mask: torch.Tensor, *, token_count: float,
                seq_count: int) -> tuple[torch.Tensor, dict[str, float]]:
    loss, raw = value_loss(values, old_values, returns, mask, cliprange_value=algo.cliprange_value,
                           loss_agg_mode=algo.loss_agg_mode, token_count=token_count,
                           seq_count=seq_count)
    return loss, {k: float(v) for k, v in raw.items()}
