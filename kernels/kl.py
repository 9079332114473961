"""Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman's k1 / k2 / k3).

The controllers of a KL penalty's coefficient live in ``kernels.kl_control``.
"""

from __future__ import annotations

import torch

__all__ = ["KL_KINDS", "kl_estimate"]

_BASE_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_KINDS = _BASE_KINDS + tuple(f"{kind}+" for kind in _BASE_KINDS)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Estimate KL(pi || pi_ref) per token from log-probs ``(B, T)`` of tokens sampled from pi.

    With ``d = logprobs - ref_logprobs``:

    - ``k1`` / ``kl``: ``d`` (unbiased, high variance, can be negative).
    - ``abs``: ``|d|``.
    - ``k2`` / ``mse``: ``d**2 / 2``.
    - ``k3`` / ``low_var_kl``: ``exp(-d) + d - 1`` (unbiased, never negative). ``-d`` is clamped
      to ±20 before the exponential and the result to ±10, as in verl, so one wild token cannot
      blow up the loss.
    - ``{kind}+`` (verl's straight-through variants, e.g. ``k3+``): the value of ``kind`` with
      the gradient of ``k2``. k1 and k3 estimate the KL without bias, but their gradients do
      not estimate the KL's gradient; k2's does (for samples from pi).

    Returns ``(B, T)``; masking and aggregation are the caller's. Checked against verl 0.9.1's
    ``kl_penalty`` (value and gradient) by ``tests/test_verl_parity.py``.
    """
    if kind.endswith("+") and kind in KL_KINDS:
        forward = kl_estimate(logprobs, ref_logprobs, kind[:-1])
        backward = 0.5 * (logprobs - ref_logprobs).square()
        return backward - backward.detach() + forward.detach()
    d = logprobs - ref_logprobs  # (B, T)
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("k2", "mse"):
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        neg = (-d).clamp(-20.0, 20.0)  # log(pi_ref / pi)
        return (torch.exp(neg) - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator kind {kind!r}; expected one of {KL_KINDS}")
