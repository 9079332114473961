"""Per-token log-probabilities and entropies from language-model logits.

Each function has two paths that compute the same numbers. The reference path
(``chunk_size=None``) is the plain one: cast the whole ``(B, T, V)`` logits to float32, take
``log_softmax`` and gather. It is easy to trust but briefly holds a float32 copy of the logits
(and autograd keeps another for the backward pass), which for a 150k vocabulary is several
gigabytes per micro-batch.

The chunked path (``chunk_size=k``) walks over ``k`` rows of the flattened ``(B*T, V)`` logits
at a time, so at most a ``(k, V)`` float32 block exists at once. It is a custom autograd
function: the forward pass keeps only the per-row ``logsumexp`` (and, for the entropy, the
per-row expected logit), and the backward pass recomputes each chunk's softmax from the
original logits. Gradients arrive in the logits' own dtype, as they do on the reference path.

Passing ``chunk_size=None`` or an integer is the switch that forces either path; the tests in
``tests/test_kernels_logprobs.py`` compare the two and report the largest difference.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    ``logits`` is ``(B, T, V)`` in any float dtype (any leading shape works), ``targets`` is the
    matching ``(B, T)`` long tensor of token ids, every id in ``[0, V)`` (padding positions must
    still hold a valid id; mask them out afterwards). The result is ``(B, T)`` float32 and
    differentiable with respect to ``logits`` on both paths.
    """
    _check_args(logits, temperature, chunk_size)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} does not match logits shape "
            f"{tuple(logits.shape)} without its vocabulary dimension"
        )
    if chunk_size is None:
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    vocab = logits.shape[-1]
    flat = _ChunkedTokenLogprob.apply(
        logits.reshape(-1, vocab), targets.reshape(-1), float(temperature), int(chunk_size)
    )  # (B*T,)
    return flat.view(targets.shape)


def entropy_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position.

    With ``z = logits / temperature`` this is ``H = logsumexp(z) - sum(softmax(z) * z)``.
    ``logits`` is ``(B, T, V)``; the result is ``(B, T)`` float32, differentiable on both paths
    (an entropy bonus needs the gradient). Logits of ``-inf`` give NaN, as in verl.
    """
    _check_args(logits, temperature, chunk_size)
    if chunk_size is None:
        z = logits.float() / temperature  # (B, T, V)
        return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)  # (B, T)
    vocab = logits.shape[-1]
    flat = _ChunkedEntropy.apply(
        logits.reshape(-1, vocab), float(temperature), int(chunk_size)
    )  # (B*T,)
    return flat.view(logits.shape[:-1])


def _check_args(logits: torch.Tensor, temperature: float, chunk_size: int | None) -> None:
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    if logits.dim() < 2:
        raise ValueError(f"logits must be (..., V), got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size}")


class _ChunkedTokenLogprob(torch.autograd.Function):
    """``z[target] - logsumexp(z)`` over row chunks; the backward pass recomputes softmax."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_size):
        # logits (N, V) any float dtype; targets (N,) long
        n = logits.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)  # (N,)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)  # (N,)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = logits[start:end].float() / temperature  # (k, V)
            row_lse = torch.logsumexp(z, dim=-1)  # (k,)
            picked = z.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1)  # (k,)
            out[start:end] = picked - row_lse
            lse[start:end] = row_lse
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        # d logp[target] / d z = onehot(target) - softmax(z); d z / d logits = 1 / temperature
        logits, targets, lse = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad_logits = torch.empty_like(logits)  # (N, V)
        n = logits.shape[0]
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = logits[start:end].float() / temperature  # (k, V)
            probs = torch.exp(z - lse[start:end].unsqueeze(-1))  # (k, V)
            g = grad_out[start:end].float().unsqueeze(-1)  # (k, 1)
            grad_z = probs.mul_(-g)  # (k, V)
            grad_z.scatter_add_(-1, targets[start:end].unsqueeze(-1), g)
            grad_logits[start:end] = grad_z.div_(temperature)
        return grad_logits, None, None, None


class _ChunkedEntropy(torch.autograd.Function):
    """``logsumexp(z) - E_p[z]`` over row chunks; the backward pass recomputes softmax."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_size):
        # logits (N, V) any float dtype
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)  # (N,)
        mean_z = torch.empty(n, dtype=torch.float32, device=logits.device)  # (N,) E_p[z]
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = logits[start:end].float() / temperature  # (k, V)
            lse[start:end] = torch.logsumexp(z, dim=-1)
            mean_z[start:end] = (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(logits, lse, mean_z)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return lse - mean_z

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        # d H / d z_j = p_j * (E_p[z] - z_j); d z / d logits = 1 / temperature
        logits, lse, mean_z = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad_logits = torch.empty_like(logits)  # (N, V)
        n = logits.shape[0]
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = logits[start:end].float() / temperature  # (k, V)
            probs = torch.exp(z - lse[start:end].unsqueeze(-1))  # (k, V)
            g = grad_out[start:end].float().unsqueeze(-1)  # (k, 1)
            grad_z = probs.mul_(mean_z[start:end].unsqueeze(-1) - z).mul_(g)  # (k, V)
            grad_logits[start:end] = grad_z.div_(temperature)
        return grad_logits, None, None
