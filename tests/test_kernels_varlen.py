"""Packed attention in one ``varlen_attn`` call against the per-sequence loop it replaces.

On a CUDA device in bf16 the learner's packed rows go through torch's varlen kernel
(``kernels/varlen_attention.py``); both paths are compared with a float32 reference of each
sequence attended alone, forward and backward, with grouped-query heads as the policy models have.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn import functional as F

from kernels import varlen_attention

BOUNDS = (0, 7, 40, 41, 100, 228)  # lengths 7, 33, 1, 59, 128
HQ, HKV, D = 8, 2, 64


def inputs(device: str, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = BOUNDS[-1]
    shapes = [(1, HQ, T, D), (1, HKV, T, D), (1, HKV, T, D)]
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in shapes]


def per_sequence(q, k, v) -> torch.Tensor:
    """The loop: SDPA on each sequence's slice; (1, T, Hq, D)."""
    outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                           is_causal=True, enable_gqa=True)
            for a, b in itertools.pairwise(BOUNDS)]
    return torch.cat(outs, dim=2).transpose(1, 2)


def test_the_fused_path_is_taken_only_on_cuda_in_half_precision():
    q = torch.zeros(1, HQ, 4, D)
    assert not varlen_attention.fused_applies(q)
    assert not varlen_attention.fused_applies(q.bfloat16())  # a CPU tensor: the loop
    cu, longest = varlen_attention.cumulative(BOUNDS, torch.device("cpu"))
    assert cu.dtype == torch.int32 and cu.tolist() == list(BOUNDS) and longest == 128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_varlen_matches_each_sequence_alone(dtype):
    if varlen_attention.varlen_kernel() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    q, k, v = inputs("cuda", dtype)
    assert varlen_attention.fused_applies(q)
    grad = torch.randn(1, BOUNDS[-1], HQ, D, generator=torch.Generator().manual_seed(1))
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = per_sequence(*ref_in)
    ref.backward(grad.cuda())
    errors = {}
    for name, fn in (("fused", lambda a, b, c: varlen_attention.fused_varlen(
            a, b, c, BOUNDS, None, gqa=True)), ("loop", per_sequence)):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins)
        assert out.shape == (1, BOUNDS[-1], HQ, D)
        out.backward(grad.to("cuda", dtype))
        errors[name] = [float((out.float() - ref).abs().max())] + [
            float((a.grad.float() - r.grad).abs().max()) for a, r in zip(ins, ref_in, strict=True)]
    print(errors)
    for fused, loop in zip(errors["fused"], errors["loop"], strict=True):
        assert fused <= 2 * loop + 1e-2, errors  # as close to float32 as the loop in half


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_varlen_matches_each_sequence_alone(dtype):
    """One SDPA call over the sequences side by side, each padded to the longest: the outputs
    and the gradients of q, k and v equal the loop's (float32: to rounding; the padding takes no
    gradient), with grouped-query heads."""
    q, k, v = inputs("cpu", dtype)
    grad = torch.randn(1, BOUNDS[-1], HQ, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = []
    for fn in (per_sequence, lambda a, b, c: varlen_attention.padded_varlen(
            a, b, c, BOUNDS, None, gqa=True)):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins)
        out.backward(grad)
        results.append([out.detach().float()] + [t.grad.float() for t in ins])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        err = float((a - b).abs().max())
        print(f"{dtype} {name}: max |diff| {err:.2e}")
        assert err <= tol * max(1.0, float(b.abs().max())), name


def test_the_padded_path_is_taken_where_padding_costs_little():
    """Lengths of one task's samples (close together): padded; one long sequence among short
    ones (the padding would be most of the arithmetic), or a single sequence: the loop."""
    assert varlen_attention.padding_pays((0, 40, 85, 131, 170))  # 40, 45, 46, 39
    assert not varlen_attention.padding_pays(BOUNDS)  # 7, 33, 1, 59, 128
    assert not varlen_attention.padding_pays((0, 50))
    gather, real, longest = varlen_attention.padded_layout((0, 2, 5), torch.device("cpu"))
    assert longest == 3 and gather.tolist() == [0, 1, 1, 2, 3, 4]  # past the end: the last token
    assert real.tolist() == [0, 1, 3, 4, 5]


# groups whose rows share a prefix: (start, prefix end, end of each row's rest...)
TREE = ((0, 20, 25, 26, 40), (40, 40, 50), (50, 60, 61, 63))
ROWS = ((0, 20, 20, 25), (0, 20, 25, 26), (0, 20, 26, 40), (40, 40, 40, 50),
        (50, 60, 60, 61), (50, 60, 61, 63))  # each row: its prefix's bounds, then its rest's


def tree_inputs(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    T = TREE[-1][-1]
    shapes = [(1, HQ, T, D), (1, HKV, T, D), (1, HKV, T, D)]
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in shapes]


def rows_alone(q, k, v) -> torch.Tensor:
    """Each row (its prefix, then its rest) attended alone in float32; the prefix's output
    from the first row that has it, each rest's from its own row: (1, T, Hq, D)."""
    out = torch.zeros(1, q.shape[2], HQ, D, dtype=torch.float32, device=q.device)
    done = set()
    for a, b, c, d in ROWS:
        idx = torch.tensor([*range(a, b), *range(c, d)], device=q.device)
        one = F.scaled_dot_product_attention(
            q.float()[:, :, idx], k.float()[:, :, idx], v.float()[:, :, idx], is_causal=True,
            enable_gqa=True).transpose(1, 2)  # (1, L, Hq, D)
        keep = [i for i, pos in enumerate(idx.tolist()) if pos not in done]
        out = out.index_put((torch.zeros(len(keep), dtype=torch.long, device=q.device),
                             idx[keep]), one[0, keep])
        done.update(idx.tolist())
    return out


def check_tree(device: str, dtype: torch.dtype, tol: float) -> None:
    q, k, v = tree_inputs(device, dtype)
    grad = torch.randn(1, TREE[-1][-1], HQ, D, generator=torch.Generator().manual_seed(5))
    results = []
    for fn in (rows_alone, lambda a, b, c: varlen_attention.tree_attention(
            a, b, c, TREE, None, gqa=True)):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins)
        out.backward(grad.to(device, out.dtype))
        results.append([out.detach().float()] + [t.grad.float() for t in ins])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        err = float((a - b).abs().max())
        print(f"{device} {dtype} {name}: max |diff| {err:.2e}")
        assert err <= tol * max(1.0, float(a.abs().max())), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention_matches_each_row_alone(dtype):
    """Shared prefixes (``learner.share_prefixes``): one masked SDPA call over the groups side
    by side gives each prefix token, and each row's rest, the attention of its row alone, and
    the same gradients (a prefix token's summed over the rows that read it), with grouped-query
    heads: a group of three rows, a row without a prefix, a group of two."""
    check_tree("cpu", dtype, 1e-5 if dtype == torch.float32 else 3e-2)
    lay = varlen_attention.tree_layout(TREE, torch.device("cpu"))
    assert (lay.longest_prefix, lay.longest_rest) == (20, 14)  # the prefixes of 20 and 10
    assert lay.mask.shape == (6, 1, 14, 34) and sorted(lay.pick.tolist()) == sorted(set(
        lay.pick.tolist())) and lay.pick.numel() == 63  # each position from one cell
    assert lay.mask[0, 0, 0, :20].all() and lay.mask[0, 0, 0, 20:].tolist() == [True] + [False] * 13
    assert not lay.mask[3, 0, :, :20].any()  # the row without a prefix: its own tokens only
    assert not lay.mask[4, 0, 0, 10:20].any()  # a prefix of 10: the padding after it unseen


@pytest.mark.gpu
def test_tree_attention_matches_each_row_alone_on_cuda():
    check_tree("cuda", torch.bfloat16, 3e-2)
