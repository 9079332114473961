"""Per-token log-probs (and entropy) straight from hidden states and the LM head weight.

The learner needs ``log_softmax(hidden @ weight.T / T)[target]`` with gradients for both the
hidden states and the (tied) head weight. Materialising the float32 ``(N, V)`` logits for
``N = 8192`` tokens and ``V = 49152`` costs 1.6 GB before the log-softmax and the backward
buffers double or triple it. ``lm_head_logprobs`` has three paths that compute the same numbers:

- ``"naive"``: the reference. ``log_softmax((hidden @ weight.T).float() / T)`` and a gather;
  autograd keeps several ``(N, V)`` tensors.
- ``"chunked"``: a custom autograd function walking ``chunk_size`` rows at a time. The forward
  pass keeps only per-row scalars (logsumexp, entropy); the backward pass recomputes each
  chunk's logits, turns them into the gradient with respect to the logits and multiplies that
  into ``grad_hidden`` and ``grad_weight``. Peak extra memory is a few ``(chunk_size, V)``
  float32 blocks. Logits are computed in the inputs' dtype, as on the naive path, and the
  softmax math in float32. A small head (``N x V`` probabilities within ``KEEP_BYTES``) keeps
  its probabilities from the forward pass instead, and a backward pass for the log-probs alone
  uses them: no logits to recompute, a quarter of the head's products.
- ``"triton"``: the same autograd function with Triton kernels (``kernels/triton_logprobs.py``):
  the forward pass is one fused online-softmax kernel over hidden and weight tiles that writes
  no ``(N, V)`` tensor at all; the backward pass writes one ``(chunk_size, V)`` gradient block
  per chunk in the inputs' dtype. The logits are accumulated in float32 and never rounded to
  bfloat16, so with bfloat16 inputs this path is slightly *more* exact than the other two.

Choosing a path, first match wins:

1. ``impl="naive" | "chunked" | "triton"`` passed by the caller;
2. the environment variable ``FLOWRL_LOGPROB_IMPL`` (same three values), when ``impl="auto"``;
3. ``impl="auto"``: ``"triton"`` for CUDA tensors when the ``triton`` package is installed,
   otherwise ``"chunked"``.

``with_sum_pi_squared`` adds a third per-row output, ``sum_v softmax(logits / T)[v]**2`` (verl's
``sum_pi_squared``, the input of the optimal-token-baseline estimators), computed in the same
pass over the logits on every path (one more row reduction; in the Triton kernel an online
accumulator beside the softmax sum). It carries no gradient: verl computes it in the no-grad
pass that recomputes the old log-probs, which is where the learner asks for it.

``tests/test_kernels_lm_head.py`` compares every path with ``"naive"`` and reports the largest
and mean differences; ``bench/bench_logprobs.py`` measures time and peak memory.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from types import ModuleType
from typing import Literal, overload

import torch
from torch.autograd.function import once_differentiable

IMPLS = ("naive", "chunked", "triton")
KEEP_BYTES = 512 << 20  # the chunked path keeps the probabilities when they take at most this
IMPL_ENV = "FLOWRL_LOGPROB_IMPL"


@overload
def lm_head_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
    temperature: float = ..., chunk_size: int = ..., with_entropy: Literal[False] = ...,
    with_sum_pi_squared: Literal[False] = ..., impl: str = ...,
) -> torch.Tensor: ...


@overload
def lm_head_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
    temperature: float = ..., chunk_size: int = ..., with_entropy: bool = ...,
    with_sum_pi_squared: bool = ..., impl: str = ...,
) -> torch.Tensor | tuple[torch.Tensor, ...]: ...


def lm_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    with_sum_pi_squared: bool = False,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Log-probability of each target token under ``softmax(hidden @ weight.T / temperature)``.

    ``hidden`` is ``(N, H)`` (flatten ``(B, T, H)`` first), ``weight`` the LM head ``(V, H)`` in
    the same float dtype and on the same device (no bias: the default model's tied head has
    none), ``targets`` the ``(N,)`` long token ids, each in ``[0, V)`` (padding positions still
    need a valid id; mask them out afterwards). Returns ``logprobs`` ``(N,)`` float32 alone, or
    a tuple of it followed by ``entropy`` (when ``with_entropy``) and ``sum_pi_squared`` (when
    ``with_sum_pi_squared``; ``sum_v p(v)**2`` per row), each ``(N,)`` float32. ``logprobs``
    and ``entropy`` carry gradients to ``hidden`` and ``weight`` on every path; an entropy that
    no loss uses costs nothing in the backward pass (``.detach()`` it to be explicit).
    ``sum_pi_squared`` is detached on every path. ``chunk_size`` rows are processed at a time on the
    chunked path and in the Triton backward pass; the naive path ignores it. ``impl`` picks the
    path; see the module docstring for how it combines with ``FLOWRL_LOGPROB_IMPL``.
    """
    _check_args(hidden, weight, targets, temperature, chunk_size)
    path = resolve_impl(impl, hidden.device)
    if path == "naive":
        logits = (hidden @ weight.T).float() / temperature  # (N, V)
        logp = torch.log_softmax(logits, dim=-1)  # (N, V)
        logprobs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N,)
        entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None  # (N,)
        sum_pi_squared = logp.detach().exp().square().sum(-1) if with_sum_pi_squared else None
    else:
        backend = _triton_backend() if path == "triton" else _CHUNKED
        # a small head's probabilities are kept for the backward pass (the chunked path, when
        # a gradient will come): recomputing the logits is a quarter of its products
        keep = (path == "chunked" and torch.is_grad_enabled()
                and (hidden.requires_grad or weight.requires_grad)
                and hidden.shape[0] * weight.shape[0] * 4 <= KEEP_BYTES)
        logprobs, entropy, sum_pi_squared = _LMHeadLogprobs.apply(
            hidden, weight, targets, float(temperature), int(chunk_size), with_entropy,
            with_sum_pi_squared, backend, keep
        )
    extras = [t for t, wanted in ((entropy, with_entropy), (sum_pi_squared, with_sum_pi_squared))
              if wanted]
    return (logprobs, *extras) if extras else logprobs


def resolve_impl(impl: str, device: torch.device) -> str:
    """The path ``lm_head_logprobs(..., impl=impl)`` takes for tensors on ``device``."""
    if impl != "auto":
        if impl not in IMPLS:
            raise ValueError(f"impl must be 'auto' or one of {IMPLS}, got {impl!r}")
        return impl
    forced = os.environ.get(IMPL_ENV, "").strip().lower()
    if forced:
        if forced not in IMPLS:
            raise ValueError(f"{IMPL_ENV} must be one of {IMPLS} or unset, got {forced!r}")
        return forced
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "chunked"


def _check_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int,
) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be (N, H), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be (V, H), got shape {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden is {tuple(hidden.shape)}, weight is "
            f"{tuple(weight.shape)}; both need the same H in their last dimension"
        )
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden and weight must share one float dtype, got {hidden.dtype} and {weight.dtype}"
        )
    if targets.dtype != torch.long or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"targets must be a long tensor of shape ({hidden.shape[0]},), got {targets.dtype} "
            f"of shape {tuple(targets.shape)}"
        )
    if not hidden.device == weight.device == targets.device:
        raise ValueError(
            f"hidden, weight and targets must be on one device, got {hidden.device}, "
            f"{weight.device} and {targets.device}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if targets.numel():
        # The Triton kernels would read a wrong logit silently; one host sync is cheap here.
        low, high = torch.aminmax(targets)
        if low.item() < 0 or high.item() >= weight.shape[0]:
            raise ValueError(
                f"targets must lie in [0, {weight.shape[0]}), got ids from {low.item()} to "
                f"{high.item()}"
            )


class _ChunkedBackend:
    """Plain torch per chunk: the same two entry points as ``kernels.triton_logprobs``."""

    @staticmethod
    def lm_head_rows(hidden, weight, targets, temperature, with_entropy, chunk_size,
                     with_sum_pi_squared=False, kept: list | None = None):
        # hidden (N, H), weight (V, H), targets (N,); ``kept``: a list to hold each chunk's
        # unnormalised probabilities and their row sums for the backward pass
        n = hidden.shape[0]
        logprob = torch.empty(n, dtype=torch.float32, device=hidden.device)  # (N,)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)  # (N,)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        sum_pi_sq = torch.empty(n if with_sum_pi_squared else 0, dtype=torch.float32,
                                device=hidden.device)
        # each pass over a (k, V) block reads and writes V floats per row, and the passes, not
        # the products, bound a small model's head on a CPU: five of them, the row sums of
        # products as batched dot products (one read of both)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = (hidden[start:end] @ weight.T).float()  # (k, V), a fresh tensor we may overwrite
            if temperature != 1.0:
                z.div_(temperature)
            top = z.amax(-1, keepdim=True)  # (k, 1)
            z.sub_(top)  # shifted: each row's largest is 0
            e = torch.exp(z)  # (k, V) unnormalised probabilities
            total = e.sum(-1)  # (k,)
            log_total = total.log()
            lse[start:end] = log_total + top.squeeze(-1)
            picked = z.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1)  # (k,)
            logprob[start:end] = picked - log_total
            if with_sum_pi_squared:  # Σ p² = Σ e² / total²
                sum_pi_sq[start:end] = _row_dot(e, e) / total.square()
            if with_entropy:  # H = -Σ p log p = log total - Σ e z / total
                entropy[start:end] = log_total - _row_dot(e, z) / total
            if kept is not None:
                kept.append((e, total))
        return logprob, lse, entropy, sum_pi_sq

    @staticmethod
    def kept_dlogits(e, total, targets, grad_logprob, temperature):
        """``dlogits`` of one chunk from the forward pass's ``e`` (its unnormalised
        probabilities, consumed) and row sums ``total``, for a gradient of the log-probs alone:
        ``g * (onehot - e / total) / T``, with no product to recompute the logits."""
        g = grad_logprob.float()  # (k,)
        dz = e.mul_((-g / total).unsqueeze(-1))  # (k, V)
        dz.scatter_add_(-1, targets.unsqueeze(-1), g.unsqueeze(-1))
        return dz.div_(temperature) if temperature != 1.0 else dz

    @staticmethod
    def dlogits(hidden, weight, targets, lse, entropy, grad_logprob, grad_entropy, temperature):
        # hidden (k, H) one chunk; targets, lse, entropy, grads (k,); returns (k, V) in
        # hidden's dtype: (g_lp * (onehot - p) - g_ent * p * (log p + H)) / T
        logp = (hidden @ weight.T).float()  # (k, V)
        if temperature != 1.0:
            logp.div_(temperature)
        logp.sub_(lse.unsqueeze(-1))
        if grad_entropy is None:
            dz = logp.exp_().mul_(-grad_logprob.float().unsqueeze(-1))
        else:
            p = torch.exp(logp)  # (k, V)
            coef = logp.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.float().unsqueeze(-1))
            if grad_logprob is not None:
                coef.add_(grad_logprob.float().unsqueeze(-1))
            dz = p.mul_(coef).neg_()  # -p * (g_lp + g_ent * (log p + H))
        if grad_logprob is not None:
            dz.scatter_add_(-1, targets.unsqueeze(-1), grad_logprob.float().unsqueeze(-1))
        if temperature != 1.0:
            dz.div_(temperature)
        return dz.to(hidden.dtype)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` of two ``(k, V)`` blocks in one pass: a batch of dot products."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)  # (k,)


_CHUNKED = _ChunkedBackend()


class _TritonBackend:
    """Adapts ``kernels.triton_logprobs`` (whose forward pass needs no chunking)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module  # looked up per call, so a reloaded module takes effect

    def lm_head_rows(self, hidden, weight, targets, temperature, with_entropy, chunk_size,
                     with_sum_pi_squared=False):
        return self.module.lm_head_rows(hidden, weight, targets, temperature, with_entropy,
                                        with_sum_pi_squared)

    def dlogits(self, *args):
        return self.module.dlogits(*args)


@functools.cache
def _triton_backend() -> _TritonBackend:
    try:
        from kernels import triton_logprobs
    except ImportError as exc:
        raise RuntimeError(
            "impl='triton' needs the triton package (pip install triton; CUDA only)"
        ) from exc
    return _TritonBackend(triton_logprobs)


class _LMHeadLogprobs(torch.autograd.Function):
    """Row-chunked log-probs and entropy (and sum_pi_squared, without a gradient); saves only
    inputs and per-row scalars for backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy,
                with_sum_pi_squared, backend, keep):
        ctx.kept = [] if keep else None
        logprob, lse, entropy, sum_pi_sq = backend.lm_head_rows(
            hidden, weight, targets, temperature, with_entropy, chunk_size, with_sum_pi_squared,
            **({"kept": ctx.kept} if keep else {})
        )  # (N,) each; entropy and sum_pi_sq are empty unless asked for
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.backend = backend
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.mark_non_differentiable(sum_pi_sq)
        ctx.set_materialize_grads(False)  # an unused output arrives as None and costs nothing
        return logprob, entropy, sum_pi_sq

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprob, grad_entropy, grad_sum_pi_sq):
        del grad_sum_pi_sq  # non-differentiable output
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if (grad_logprob is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, None, None, None, None, None, None, None
        n = hidden.shape[0]
        grad_hidden = grad_weight = None
        if need_hidden:
            grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        kept = ctx.kept if grad_entropy is None and grad_logprob is not None else None
        ctx.kept = None  # (what it held is consumed below)
        for i, start in enumerate(range(0, n, ctx.chunk_size)):
            end = min(start + ctx.chunk_size, n)
            h = hidden[start:end]  # (k, H)
            if kept is not None:
                e, total = kept[i]
                dz = _ChunkedBackend.kept_dlogits(e, total, targets[start:end],
                                                  grad_logprob[start:end], ctx.temperature)
            else:
                dz = ctx.backend.dlogits(
                    h,
                    weight,
                    targets[start:end],
                    lse[start:end],
                    entropy[start:end],
                    None if grad_logprob is None else grad_logprob[start:end],
                    None if grad_entropy is None else grad_entropy[start:end],
                    ctx.temperature,
                )  # (k, V) in hidden's dtype
            dz = dz.to(hidden.dtype)
            if need_hidden:
                torch.mm(dz, weight, out=grad_hidden[start:end])
            if need_weight:
                # summed over chunks in float32, rounded to the weight's dtype once at the end;
                # the first chunk's product is the sum's start (no (V, H) zeros to fill)
                if grad_weight is None:
                    grad_weight = (dz.T @ h).float()
                elif dz.dtype == torch.float32:
                    grad_weight.addmm_(dz.T, h)
                else:
                    grad_weight += dz.T @ h
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )
