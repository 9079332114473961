"""Off-policy correction between the behaviour policy mu and the proximal policy pi_old.

mu is the sampler's policy: its per-token log-probs come back with each trajectory and may be
several weight versions old (or the same weights in another numeric format). pi_old is the
learner's policy at the start of the current step, recomputed on the same tokens. Every
function here works from the per-token log-ratio ``log rho = lp_old - lp_behav`` over the
response tokens selected by the 0/1 ``mask``, all ``(B, T)``.

Truncated importance sampling (TIS) turns rho into detached loss weights, ``normalize_weights``
rescales them to mean 1; ``mismatch_metrics`` reports how far apart the two policies are, under
verl's ``rollout_corr/`` names. Rejection (masked IS) lives in ``kernels.rejection`` and the
staleness histogram in ``kernels.staleness``; both are re-exported here.
"""

from __future__ import annotations

import math

import torch

from kernels.masked import masked_mean
from kernels.ratios import LOG_RATIO_BOUND, masked_log_ratio
from kernels.rejection import RejectionRule, parse_rs_preset, rejection_mask
from kernels.staleness import staleness_histogram

__all__ = [
    "IS_LEVELS",
    "LOG_RATIO_BOUND",
    "METRIC_NAMES",
    "RejectionRule",
    "mismatch_metrics",
    "normalize_weights",
    "parse_rs_preset",
    "rejection_mask",
    "staleness_histogram",
    "truncated_is_weights",
]

IS_LEVELS = ("token", "sequence")

METRIC_NAMES = (
    "rollout_corr/is_weight_mean",
    "rollout_corr/is_weight_std",
    "rollout_corr/is_weight_min",
    "rollout_corr/is_weight_max",
    "rollout_corr/rho_max",
    "rollout_corr/ess",
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/training_ppl",
    "rollout_corr/rollout_ppl",
    "rollout_corr/log_ppl_diff",
    "rollout_corr/chi2_token",
    "rollout_corr/chi2_seq",
)


def truncated_is_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``min(rho, cap)`` of pi_old over mu, detached, ``(B, T)``.

    At ``level="token"`` each token gets its own ``rho_t = exp(clamp(lp_old - lp_behav, ±20))``.
    At ``level="sequence"`` every token of a sequence gets the sequence ratio
    ``exp(clamp(sum_t log rho_t, ±20))`` over its masked tokens: unbiased for sequence-level
    rewards but with a variance that grows with length. Either way the weight is capped at
    ``cap`` and is 0 outside the mask.

    The metrics hold ``rollout_corr/is_clip_frac``: the fraction of masked tokens whose ratio
    (the token's, or its sequence's) exceeded ``cap``. Add ``mismatch_metrics`` for the rest.
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    if level not in IS_LEVELS:
        raise ValueError(f"unknown IS level {level!r}; expected one of {IS_LEVELS}")
    with torch.no_grad():
        log_rho = masked_log_ratio(old_logprobs, behaviour_logprobs, mask)  # (B, T)
        if level == "sequence":
            seq_log_rho = log_rho.sum(-1, keepdim=True)  # (B, 1)
            log_rho = seq_log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).expand_as(log_rho)
        rho = torch.exp(log_rho)  # (B, T)
        keep = mask.bool()
        weights = torch.where(keep, rho.clamp(max=cap), torch.zeros_like(rho))  # (B, T)
        clip_frac = masked_mean((rho > cap).float(), mask)
    return weights, {"rollout_corr/is_clip_frac": clip_frac.item()}


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
) -> dict[str, float]:
    """How far the behaviour policy mu is from pi_old, as Python floats (verl names).

    Token statistics are over masked tokens; sequence statistics over rows with at least one
    masked token. rho is the token ratio ``exp(clamp(lp_old - lp_behav, ±20))``.

    - ``rollout_corr/is_weight_mean|std|min|max``: of ``weights`` (std is the population std).
    - ``rollout_corr/rho_max``: the largest raw token rho, before any cap.
    - ``rollout_corr/ess``: normalised effective sample size ``1 / mean(w_hat**2)`` with
      ``w_hat = w / mean(w)``, i.e. ``mean(w)**2 / mean(w**2)``, in (0, 1]; 1 means uniform.
    - ``rollout_corr/kl``: ``mean(lp_behav - lp_old)``, the k1 estimate of KL(mu || pi_old).
    - ``rollout_corr/k3_kl``: ``mean(rho - 1 - log rho)``, the k3 estimate of the same
      KL(mu || pi_old). The tokens were sampled from mu, so mu is the distribution the
      expectation is under; this is ``kernels.kl`` k3 with ``logprobs = lp_behav`` and
      ``ref_logprobs = lp_old`` (``exp(-d) + d - 1``, ``d = lp_behav - lp_old``), without the
      ±10 output clamp so a large mismatch shows in full. It matches verl's ``k3_kl``.
    - ``rollout_corr/training_ppl``: ``exp(-mean_t lp_old)`` per sequence, averaged.
    - ``rollout_corr/rollout_ppl``: the same with ``lp_behav``.
    - ``rollout_corr/log_ppl_diff``: per-sequence ``mean_t lp_behav - mean_t lp_old``
      (= log training_ppl - log rollout_ppl of that sequence), averaged.
    - ``rollout_corr/chi2_token``: ``mean(rho**2) - 1``, chi-square divergence of pi_old from mu.
    - ``rollout_corr/chi2_seq``: ``mean_seq(prod_t rho_t)**2 - 1`` (sequence log-ratio
      clamped to ±20).

    An empty mask gives NaN for every metric.
    """
    if not mask.bool().any():
        return dict.fromkeys(METRIC_NAMES, math.nan)
    with torch.no_grad():
        keep = mask.bool()  # (B, T)
        old = old_logprobs.float()
        behav = behaviour_logprobs.float()
        w = weights.float()
        log_rho = masked_log_ratio(old, behav, mask)  # (B, T)
        rho = torch.exp(log_rho)  # (B, T)

        w_mean = masked_mean(w, mask)
        w_sq_mean = masked_mean(w.square(), mask)
        w_std = (w_sq_mean - w_mean.square()).clamp_min(0).sqrt()
        inf = torch.tensor(math.inf, device=w.device)
        w_min = torch.where(keep, w, inf).min()
        w_max = torch.where(keep, w, -inf).max()
        rho_max = torch.where(keep, rho, -inf).max()
        ess = torch.where(w_sq_mean > 0, w_mean.square() / w_sq_mean, torch.zeros_like(w_mean))

        kl_k1 = masked_mean(-log_rho, mask)
        kl_k3 = masked_mean(torch.expm1(log_rho) - log_rho, mask)
        chi2_token = masked_mean(rho.square(), mask) - 1.0

        seqs = keep.any(-1)  # (B,) rows with at least one response token
        seq_old = masked_mean(old, mask, dim=-1)[seqs]  # (S,) mean token lp per sequence
        seq_behav = masked_mean(behav, mask, dim=-1)[seqs]  # (S,)
        training_ppl = torch.exp(-seq_old).mean()
        rollout_ppl = torch.exp(-seq_behav).mean()
        log_ppl_diff = (seq_behav - seq_old).mean()
        seq_log_rho = log_rho.sum(-1)[seqs].clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (S,)
        chi2_seq = torch.exp(2.0 * seq_log_rho).mean() - 1.0

        values = torch.stack(
            [
                w_mean,
                w_std,
                w_min,
                w_max,
                rho_max,
                ess,
                kl_k1,
                kl_k3,
                training_ppl,
                rollout_ppl,
                log_ppl_diff,
                chi2_token,
                chi2_seq,
            ]
        ).tolist()  # one device sync for all metrics
    return dict(zip(METRIC_NAMES, values, strict=True))


def normalize_weights(
    weights: torch.Tensor, mask: torch.Tensor, *, level: str = "token"
) -> torch.Tensor:
    """Importance weights ``(B, T)`` rescaled to mean 1 over the batch, detached (verl
    ``rollout_is_batch_normalize``).

    At ``level="token"`` the mean is over masked tokens. At ``level="sequence"`` it is over
    sequences (rows with at least one masked token) of each sequence's mean weight, so that
    sequence-level weights count once per sequence rather than once per token, as in verl.
    Normalising trades the bias of truncation for a step size that does not shrink when most
    weights are capped. Weights whose mean is at most 1e-8 (all zero, say) are returned unscaled,
    as in verl; positions outside the mask are 0 either way.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown IS level {level!r}; expected one of {IS_LEVELS}")
    if weights.shape != mask.shape:
        raise ValueError(f"weights shape {tuple(weights.shape)} != mask shape {tuple(mask.shape)}")
    with torch.no_grad():
        keep = mask.bool()  # (B, T)
        w = torch.where(keep, weights.detach(), torch.zeros_like(weights))  # (B, T)
        if level == "token":
            mean = masked_mean(w, mask)
        else:
            seqs = keep.any(-1)  # (B,)
            seq_means = masked_mean(w, mask, dim=-1)  # (B,)
            mean = masked_mean(seq_means, seqs)
        scale = torch.where(mean > 1e-8, 1.0 / mean.clamp_min(1e-8), torch.ones_like(mean))
        return w * scale
