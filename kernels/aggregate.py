"""Loss aggregation (verl ``loss_agg_mode``): a per-token loss ``(B, T)`` to a scalar.

A learner step usually splits its mini-batch into micro-batches and accumulates gradients. For
the sum of micro-batch losses to equal the loss of the whole mini-batch, each micro-batch must
divide by the mini-batch's normaliser, not its own: pass ``token_count`` (response tokens in the
whole mini-batch) for ``token-mean``, ``seq_count`` (sequences with at least one response token
in the whole mini-batch) for the ``seq-mean-*`` modes. Left out, the normaliser is taken from
the micro-batch itself, which is right only when there is a single micro-batch.
"""

from __future__ import annotations

import torch

from kernels.masked import masked_sum

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
             "seq-mean-token-sum-norm")


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    token_count: int | torch.Tensor | None = None,
    seq_count: int | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``(B, T)`` over the 0/1 ``mask`` ``(B, T)`` to a scalar.

    Modes (verl ``loss_agg_mode``):

    - ``token-mean``: ``sum(loss over masked tokens) / token_count`` (default: the mask's sum).
    - ``token-sum``: ``sum(loss over masked tokens)``, no normaliser (verl's; the loss scale
      then grows with the number of tokens, so the learning rate must account for it).
    - ``seq-mean-token-sum``: each sequence's token sum, averaged over sequences.
    - ``seq-mean-token-mean``: each sequence's token mean, averaged over sequences.
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): each sequence's token sum divided by
      ``norm_constant``, averaged over sequences. ``norm_constant`` defaults to ``T``, but it
      should be a constant such as the maximum response length, or the loss scale drifts with
      the padding of each micro-batch.

    Sequences are averaged over ``seq_count``, by default the number of rows holding at least
    one masked token (all-padding rows do not dilute the mean). A zero normaliser gives a zero
    loss instead of NaN. See the module docstring for micro-batching. Every mode is checked
    against verl 0.9.1's ``agg_loss`` by ``tests/test_verl_parity.py`` (verl divides a
    sequence's token sum by ``tokens + 1e-8`` in ``seq-mean-token-mean``; the difference is
    below 1e-8 relative).
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(
            f"loss_mat shape {tuple(loss_mat.shape)} != mask shape {tuple(mask.shape)}"
        )
    if mode == "token-mean":
        count = mask.bool().sum() if token_count is None else token_count
        return masked_sum(loss_mat, mask) / _at_least_one(count)
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    seq_tokens = mask.bool().sum(-1)  # (B,)
    seq_sums = masked_sum(loss_mat, mask, dim=-1)  # (B,)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sums
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sums / seq_tokens.clamp_min(1)
    elif mode == "seq-mean-token-sum-norm":
        constant = loss_mat.shape[-1] if norm_constant is None else norm_constant
        if not constant > 0:
            raise ValueError(f"norm_constant must be > 0, got {norm_constant}")
        per_seq = seq_sums / constant
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {AGG_MODES}")
    count = (seq_tokens > 0).sum() if seq_count is None else seq_count
    return per_seq.sum() / _at_least_one(count)


def _at_least_one(count: int | torch.Tensor) -> int | torch.Tensor:
    if isinstance(count, torch.Tensor):
        return count.clamp_min(1)
    return max(count, 1)
