"""Triton kernels for per-token log-probs and entropy straight from hidden states and the LM head.

Two kernels, both reading ``hidden (N, H)`` and ``weight (V, H)`` tile by tile and
accumulating the logits ``hidden @ weight.T`` in float32 registers, so the forward pass never
writes any ``(N, V)`` tensor:

- ``_lm_head_fwd_kernel`` walks the vocabulary in tiles of ``BLOCK_V`` columns with an online
  softmax. Per row it keeps the running max ``m``, ``s = sum exp(z - m)`` and, for the entropy,
  ``b = sum exp(z - m) * (z - m)``; at the end ``lse = m + log s`` and ``entropy = log s - b / s``
  (no cancellation between two large numbers, unlike ``lse - E_p[z]``). For verl's
  ``sum_pi_squared`` it also keeps ``q = sum exp(2 (z - m))`` (rescaled by ``alpha**2`` when
  ``m`` moves), and ``sum_v p(v)**2 = q / s**2``.
- ``_dlogits_kernel`` recomputes one ``(BLOCK_N, BLOCK_V)`` tile of logits and writes the
  gradient with respect to them, ``(g_lp * (onehot - p) - g_ent * p * (log p + H)) / T``, in the
  inputs' dtype. The backward pass in ``kernels/lm_head_logprobs.py`` calls it one row chunk at
  a time and multiplies the result into ``grad_hidden`` and ``grad_weight`` with cuBLAS, so the
  backward pass holds one ``(chunk, V)`` block at a time.

Importing this module imports ``triton``; ``kernels/lm_head_logprobs.py`` imports it only when
the Triton path is asked for. The kernels run on CUDA tensors, or on CPU tensors under the
Triton interpreter when ``TRITON_INTERPRET=1`` was set before this module was imported (the
choice is fixed when ``@triton.jit`` runs; ``INTERPRETED`` records it). Block sizes are fixed,
not autotuned: they have been run only under the interpreter so far, never timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _logit_tile(
    h_ptr,
    w_ptr,
    rows,  # (BLOCK_N,) int64 row ids
    cols,  # (BLOCK_V,) int64 vocabulary ids
    row_mask,
    col_mask,
    hidden,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """``hidden[rows] @ weight[cols].T`` accumulated in float32: ``(BLOCK_N, BLOCK_V)``."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        ks = h0 + tl.arange(0, BLOCK_H)
        k_mask = ks < hidden
        h_tile = tl.load(
            h_ptr + rows[:, None] * stride_hn + ks[None, :] * stride_hh,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_N, BLOCK_H)
        w_tile = tl.load(
            w_ptr + cols[None, :] * stride_wv + ks[:, None] * stride_wh,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )  # (BLOCK_H, BLOCK_V)
        if UPCAST:
            h_tile = h_tile.to(tl.float32)
            w_tile = w_tile.to(tl.float32)
        acc = tl.dot(h_tile, w_tile, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _lm_head_fwd_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    logprob_ptr,
    lse_ptr,
    ent_ptr,
    sq_ptr,
    n_rows,
    vocab,
    hidden,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    inv_temp,
    WITH_ENTROPY: tl.constexpr,
    WITH_SUM_PI_SQ: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=0)
    # A finite start for m keeps s * (m - m_new) at 0 * finite on the first tile, not 0 * inf.
    m = tl.full((BLOCK_N,), -1e30, dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum exp(z - m)
    b = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum exp(z - m) * (z - m)
    q = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum exp(2 (z - m))
    picked = tl.zeros((BLOCK_N,), dtype=tl.float32)  # z[target]
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_mask = cols < vocab
        z = _logit_tile(
            h_ptr, w_ptr, rows, cols, row_mask, col_mask, hidden,
            stride_hn, stride_hh, stride_wv, stride_wh,
            BLOCK_N, BLOCK_V, BLOCK_H, INPUT_PRECISION, UPCAST,
        ) * inv_temp  # (BLOCK_N, BLOCK_V)
        z = tl.where(col_mask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new[:, None])  # 0 in masked columns
        if WITH_ENTROPY:
            shifted = tl.where(col_mask[None, :], z - m_new[:, None], 0.0)
            b = alpha * (b + s * (m - m_new)) + tl.sum(e * shifted, axis=1)
        if WITH_SUM_PI_SQ:
            q = q * alpha * alpha + tl.sum(e * e, axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        m = m_new
        picked += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(lse_ptr + rows, lse, mask=row_mask)
    tl.store(logprob_ptr + rows, picked - lse, mask=row_mask)
    if WITH_ENTROPY:
        tl.store(ent_ptr + rows, log_s - b / s, mask=row_mask)
    if WITH_SUM_PI_SQ:
        tl.store(sq_ptr + rows, q / (s * s), mask=row_mask)


@triton.jit
def _dlogits_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    dz_ptr,
    n_rows,
    vocab,
    hidden,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    stride_dn,
    inv_temp,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < n_rows
    col_mask = cols < vocab
    z = _logit_tile(
        h_ptr, w_ptr, rows, cols, row_mask, col_mask, hidden,
        stride_hn, stride_hh, stride_wv, stride_wh,
        BLOCK_N, BLOCK_V, BLOCK_H, INPUT_PRECISION, UPCAST,
    ) * inv_temp  # (BLOCK_N, BLOCK_V)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    logp = z - lse[:, None]
    p = tl.exp(logp)
    dz = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if HAS_GLP:
        # d logp[target] / d z = onehot(target) - p
        g = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
        tgt = tl.load(tgt_ptr + rows, mask=row_mask, other=0)
        dz += tl.where(cols[None, :] == tgt[:, None], g[:, None], 0.0) - p * g[:, None]
    if HAS_GENT:
        # d H / d z = -p * (log p + H)
        g = tl.load(gent_ptr + rows, mask=row_mask, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
        dz -= p * (logp + ent[:, None]) * g[:, None]
    dz = dz * inv_temp  # d z / d logits = 1 / temperature
    tl.store(
        dz_ptr + rows[:, None] * stride_dn + cols[None, :],
        dz.to(dz_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
"""Whether the kernels above were built for the Triton interpreter (CPU tensors) or for CUDA."""

_BLOCK_N = 64
_BLOCK_V = 64
_BLOCK_H = 64
_NUM_WARPS = 4


def _input_precision(dtype: torch.dtype) -> str:
    # Only float32 operands are affected: they follow torch's own matmul setting, so "highest"
    # (torch's default) means exact float32 products, no TF32. "tf32" is Triton's default.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    # The interpreter keeps bfloat16 as uint16 bit patterns and its tl.dot multiplies those
    # (triton-lang/triton#11584; its docs say to cast bfloat16 to float32 first). bf16 x bf16
    # products are exact in float32, so the upcast dot equals a bf16 dot with float32
    # accumulation up to summation order; on the GPU the tensor-core bf16 dot is used.
    return INTERPRETED and dtype == torch.bfloat16


def _check_device(t: torch.Tensor) -> None:
    if not (t.is_cuda or INTERPRETED):
        raise RuntimeError(
            "the Triton log-prob kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
            "kernels.triton_logprobs is imported (CPU, for tests)"
        )


def lm_head_rows(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(logprob, logsumexp, entropy, sum_pi_squared)``, each ``(N,)`` float32, without
    ``(N, V)`` logits.

    ``entropy`` (``sum_pi_squared``) is an empty tensor when ``with_entropy``
    (``with_sum_pi_squared``) is false. Arguments are assumed valid (``kernels.lm_head_logprobs``
    checks them).
    """
    _check_device(hidden)
    n, hid = hidden.shape
    vocab = weight.shape[0]
    targets = targets.contiguous()
    logprob = torch.empty(n, dtype=torch.float32, device=hidden.device)  # (N,)
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)  # (N,)
    entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
    sum_pi_sq = torch.empty(n if with_sum_pi_squared else 0, dtype=torch.float32,
                            device=hidden.device)
    if n == 0:  # no response tokens in the batch; an empty grid is not launchable
        return logprob, lse, entropy, sum_pi_sq
    grid = (triton.cdiv(n, _BLOCK_N),)
    _lm_head_fwd_kernel[grid](
        hidden, weight, targets, logprob, lse, entropy, sum_pi_sq,
        n, vocab, hid,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        1.0 / temperature,
        WITH_ENTROPY=with_entropy, WITH_SUM_PI_SQ=with_sum_pi_squared,
        BLOCK_N=_BLOCK_N, BLOCK_V=_BLOCK_V, BLOCK_H=_BLOCK_H,
        INPUT_PRECISION=_input_precision(hidden.dtype),
        UPCAST=_upcast(hidden.dtype),
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    return logprob, lse, entropy, sum_pi_sq


def dlogits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """Gradient of the loss with respect to the logits ``hidden @ weight.T`` of these rows.

    ``hidden`` is one chunk ``(k, H)``; the other row tensors are the matching ``(k,)`` slices.
    Returns ``(k, V)`` in ``hidden``'s dtype. A ``None`` upstream gradient drops its term.
    """
    _check_device(hidden)
    k, hid = hidden.shape
    vocab = weight.shape[0]
    dz = torch.empty(k, vocab, dtype=hidden.dtype, device=hidden.device)  # (k, V)
    grid = (triton.cdiv(k, _BLOCK_N), triton.cdiv(vocab, _BLOCK_V))
    _dlogits_kernel[grid](
        hidden, weight, targets.contiguous(), lse.contiguous(), entropy.contiguous(),
        grad_logprob.float().contiguous() if grad_logprob is not None else lse,
        grad_entropy.float().contiguous() if grad_entropy is not None else lse,
        dz,
        k, vocab, hid,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), dz.stride(0),
        1.0 / temperature,
        HAS_GLP=grad_logprob is not None, HAS_GENT=grad_entropy is not None,
        BLOCK_N=_BLOCK_N, BLOCK_V=_BLOCK_V, BLOCK_H=_BLOCK_H,
        INPUT_PRECISION=_input_precision(hidden.dtype),
        UPCAST=_upcast(hidden.dtype),
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    return dz
