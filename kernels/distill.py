"""On-policy distillation: the per-token reverse KL to a teacher as an advantage.

The student samples; a teacher scores the student's own tokens. With ``s_t`` the student's
log-prob of sampled token ``t`` (the behaviour log-prob the sampler recorded) and ``u_t`` the
teacher's log-prob of the same token, ``d_t = KL_kind(s_t, u_t)`` (``k1``: ``s_t - u_t``, the
sampled reverse KL) and

    A_t = -weight * clamp(d_t, -kl_clamp, kl_clamp)        on response tokens, 0 elsewhere

is the distillation advantage, used alone or added to the task reward's advantage. No baseline
and no discount: each token is its own one-step return (Thinking Machines, "On-Policy
Distillation", 2025: ``advantage = -(student_logprob - teacher_logprob)``).

The references, and where this follows them:

- verl 0.9.1 (PR 5041), ``verl/trainer/distillation/losses.py``: ``distillation_losses =
  kl_penalty(student, teacher, loss_mode)``, clamped to ``±loss_max_clamp`` (default 10.0),
  and with ``use_policy_gradient`` the PPO advantage is ``-distillation_losses.detach()``; with
  ``use_task_rewards`` the task's PPO loss is added with ``distillation_loss_coef``. Our
  ``kind``, ``kl_clamp``, ``weight`` and ``task_rewards`` are those knobs. Two deliberate
  differences: verl's student log-probs are π_θ's of the update's forward pass, ours are the
  sampler's (recorded with the sample: the advantage is fixed before the step, so ``replay
  --step`` reproduces it); and verl adds a second PPO loss term while here the advantages are
  summed into one (slime's form, below), which equals verl's sum of losses wherever neither
  term is clipped.
- slime, ``slime/backends/megatron_utils/loss.py`` ``apply_opd_kl_to_advantages``:
  ``advantages[i] = adv - opd_kl_coef * (student_log_probs[i] - teacher_log_probs[i])``, no clamp.
  ``kl_clamp = 0`` gives exactly that.
- prime-rl, ``src/prime_rl/trainer/rl/loss.py`` ``opd_loss_fn``: advantage
  ``teacher_logprobs - trainer_logprobs`` (detached), the task advantage dropped (weight 1).

``tests/test_kernels_distill.py`` checks the function against verl's ``kl_penalty`` path and
slime's formula.
"""

from __future__ import annotations

import torch

from kernels.kl import kl_estimate
from kernels.masked import masked_mean

__all__ = ["DISTILL_KL_KINDS", "distill_advantages", "reverse_kl_metrics"]

DISTILL_KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")  # verl's loss_mode names


def distill_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       response_mask: torch.Tensor, *, weight: float = 1.0, kind: str = "k1",
                       kl_clamp: float = 10.0,
                       task_advantages: torch.Tensor | None = None) -> torch.Tensor:
    """The advantages ``(N, T)``: ``task_advantages`` (or 0) plus ``-weight * clamp(d)``, 0 off
    ``response_mask``; no gradient. ``kl_clamp <= 0`` clamps nothing (slime's form)."""
    if kind not in DISTILL_KL_KINDS:
        raise ValueError(f"unknown distillation KL kind {kind!r}; expected one of {DISTILL_KL_KINDS}")
    if student_logprobs.shape != teacher_logprobs.shape or student_logprobs.shape != response_mask.shape:
        raise ValueError(f"shapes differ: student {tuple(student_logprobs.shape)}, teacher "
                         f"{tuple(teacher_logprobs.shape)}, mask {tuple(response_mask.shape)}")
    with torch.no_grad():
        d = kl_estimate(student_logprobs.detach(), teacher_logprobs.detach(), kind)  # (N, T)
        if kl_clamp > 0:
            d = d.clamp(-kl_clamp, kl_clamp)
        keep = response_mask.bool()
        zero = torch.zeros((), dtype=d.dtype, device=d.device)
        adv = torch.where(keep, -weight * d, zero)
        if task_advantages is not None:
            adv = adv + torch.where(keep, task_advantages.detach().to(d.dtype), zero)
        return adv


def reverse_kl_metrics(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       response_mask: torch.Tensor) -> dict[str, float]:
    """``distill/reverse_kl/mean`` (the sampled per-token reverse KL ``s - u``, averaged over
    the response tokens: it falls as the student learns toward the teacher), its max and min,
    and the mean k3 estimate (never negative)."""
    with torch.no_grad():
        keep = response_mask.bool()
        d = student_logprobs - teacher_logprobs
        at = d[keep]
        if at.numel() == 0:
            return {"distill/reverse_kl/mean": 0.0, "distill/reverse_kl/max": 0.0,
                    "distill/reverse_kl/min": 0.0, "distill/reverse_kl/k3": 0.0,
                    "distill/teacher_logprob/mean": 0.0}
        return {"distill/reverse_kl/mean": float(at.mean()), "distill/reverse_kl/max": float(at.max()),
                "distill/reverse_kl/min": float(at.min()),
                "distill/reverse_kl/k3": float(masked_mean(
                    kl_estimate(student_logprobs, teacher_logprobs, "k3"), response_mask)),
                "distill/teacher_logprob/mean": float(teacher_logprobs[keep].mean())}
