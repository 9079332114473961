"""Attention over packed sequences without a (T, T) mask (varlen on any device).

A packed row of ``T`` tokens holds several sequences back to back (``actors/learner/packing.py``).
transformers' own packed path for SDPA and eager attention builds a ``(T, T)`` block-diagonal
mask and attends over the whole row, so its cost grows with ``T²`` where the sequences need
``Σ L_i²``: on a CPU that waste ate the padding saved (measured in BENCHMARKS.md).
flash-attention's varlen kernel has no such waste, but it is CUDA-only and not always installed.

``flowrl_varlen`` is an attention implementation registered with transformers that runs
``scaled_dot_product_attention`` with ``is_causal=True`` on each sequence's slice of q, k and v
(the sequence bounds arrive as the ``flowrl_bounds`` keyword, which transformers hands every
attention call of the forward pass, and again when gradient checkpointing recomputes a layer),
and concatenates the outputs: no token attends across a boundary, and no mask is built. Where
the sequences' lengths are close (a batch of one task's samples), one call takes them all side
by side, each padded to the longest (``padded_varlen``): the same result in a dozen ops a layer.
On a CUDA device in bf16 or fp16, where torch has ``torch.nn.attention.varlen.varlen_attn``
(its own flash-attention varlen kernel), the whole row goes through that kernel in one call per
layer instead: one launch where the loop makes one per sequence, and the loop's launches, not the
GPU's arithmetic, bound a learner step of many short sequences (the profile in BENCHMARKS.md).
Without ``flowrl_bounds`` (padded rows) it is transformers' SDPA, with the same masks: a model
switched to it computes padded batches exactly as before.

``packed_call`` gives the keyword arguments of a packed forward for the model's implementation:
this one's bounds, or for any other (flash-attention, SDPA, eager) no attention mask and the
position ids, from which transformers detects the packed format itself. The reference for both is
each sequence run alone (``tests/test_packing.py``).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
from dataclasses import dataclass

import torch
from torch.nn import functional as F

NAME = "flowrl_varlen"


def varlen_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                scaling: float | None = None, flowrl_bounds: tuple[int, ...] | None = None,
                flowrl_tree: tuple[tuple[int, ...], ...] | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (1, Hq, T, D), k and v (1, Hkv, T, D);
    returns (1, T, Hq, D)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if flowrl_tree is not None:
        return tree_attention(query, key, value, flowrl_tree, scaling, query.shape[1] !=
                              key.shape[1], dropout), None
    if flowrl_bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    if fused_applies(query):
        return fused_varlen(query, key, value, flowrl_bounds, scaling, gqa), None
    if padding_pays(flowrl_bounds):
        return padded_varlen(query, key, value, flowrl_bounds, scaling, gqa, dropout), None
    outs = [F.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout, scale=scaling,
        is_causal=True, enable_gqa=gqa) for a, b in itertools.pairwise(flowrl_bounds)]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None  # (1, T, Hq, D)


PADDING_WASTE = 2.0  # padded attention's arithmetic, at most this many times the sequences' own


@functools.lru_cache(maxsize=256)
def padding_pays(bounds: tuple[int, ...]) -> bool:
    """Whether the row's sequences go through one SDPA call side by side, each padded to the
    longest (``padded_varlen``: a dozen ops per layer, where the loop makes four per sequence,
    and those ops' dispatch, not their arithmetic, bounds a step of many short sequences), or one
    call each: padded when the padding costs at most ``PADDING_WASTE`` times the attention's own
    arithmetic (``B·L²`` against ``Σ Lᵢ²``), as it does for a batch of one task's samples."""
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    return len(lengths) > 1 and \
        len(lengths) * max(lengths) ** 2 <= PADDING_WASTE * sum(n * n for n in lengths)


@functools.lru_cache(maxsize=64)
def padded_layout(bounds: tuple[int, ...], device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For ``bounds``: the packed-row position of each (sequence, offset) cell of the padded
    layout, row-major (a cell past its sequence's end takes the sequence's last token: causal
    attention keeps it from every real query, and its own output is dropped); the cells holding
    the real tokens, in packed order; the longest sequence (cached: every layer of a forward
    asks for the same)."""
    starts = torch.tensor(bounds[:-1])
    lengths = torch.tensor(bounds[1:]) - starts  # (B,)
    longest = int(lengths.max())
    offsets = torch.arange(longest)  # (L,)
    gather = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)  # (B, L)
    cells = torch.arange(len(lengths) * longest).view(-1, longest)  # (B, L)
    real = cells[offsets[None, :] < lengths[:, None]]  # (T,) row-major: the packed order
    return gather.flatten().to(device), real.to(device), longest


def padded_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  bounds: tuple[int, ...], scaling: float | None, gqa: bool,
                  dropout: float = 0.0) -> torch.Tensor:
    """Causal attention within each ``bounds`` slice as one SDPA call over the sequences side by
    side, each padded to the longest: q (1, Hq, T, D), k and v (1, Hkv, T, D) in; (1, T, Hq,
    D) out, as ``varlen_sdpa`` returns. Each real query attends to its own sequence's prefix
    exactly as alone; the padding's queries, keys and values get no gradient."""
    gather, real, longest = padded_layout(tuple(bounds), query.device)
    rows = len(bounds) - 1

    def padded(t: torch.Tensor) -> torch.Tensor:  # (1, H, T, D) -> (B, H, L, D)
        return t[0].index_select(1, gather).unflatten(1, (rows, longest)).transpose(0, 1)

    out = F.scaled_dot_product_attention(padded(query), padded(key), padded(value),
                                         dropout_p=dropout, scale=scaling, is_causal=True,
                                         enable_gqa=gqa)  # (B, Hq, L, D)
    return out.transpose(1, 2).flatten(0, 1).index_select(0, real).unsqueeze(0)  # (1, T, Hq, D)


def shares(tree: tuple[tuple[int, ...], ...]) -> bool:
    """Whether some group of ``tree`` has a prefix its rows share (else plain sequences)."""
    return any(g[1] > g[0] for g in tree)


@dataclass(frozen=True)
class TreeLayout:
    """Where ``tree_attention`` reads and writes, for one ``tree`` (cached per tree: every layer
    of a forward, and its recomputation, asks for the same)."""

    queries: torch.Tensor  # (Gp·P + C·R,) the packed positions of the queries, in one gather:
    # the prefixes side by side, each padded to the longest P with its last token (causal
    # attention keeps the padding from real queries), then the rests, each padded to the
    # longest R
    keys: torch.Tensor  # (Gp·P + C·(P+R),) of the keys and values: the prefixes as above, then
    # each rest's, its group's prefix (padded) and itself
    prefixes: int  # Gp, the groups with a prefix
    longest_prefix: int
    mask: torch.Tensor  # (C, 1, R, P+R) bool: the prefix's real cells, then causal over the rest
    longest_rest: int
    pick: torch.Tensor  # (T,) for each packed position, its cell among the prefixes' then the
    # rests' outputs


@functools.lru_cache(maxsize=64)
def tree_layout(tree: tuple[tuple[int, ...], ...], device: torch.device) -> TreeLayout:
    """``tree_attention``'s layout of ``tree`` (groups as ``(start, prefix end, end of each
    rest...)``)."""
    prefixes = [(g[0], g[1]) for g in tree if g[1] > g[0]]
    rests = [(a, b, g[0], g[1]) for g in tree for a, b in itertools.pairwise(g[1:])]
    P = max((b - a for a, b in prefixes), default=0)
    R = max(b - a for a, b, _, _ in rests)
    pick = [0] * tree[-1][-1]
    padded = []
    for n, (a, b) in enumerate(prefixes):
        padded.extend([*range(a, b), *[b - 1] * (P - (b - a))])
        for t in range(a, b):
            pick[t] = n * P + (t - a)
    queries, keys, seen = list(padded), list(padded), []
    for n, (a, b, pa, pb) in enumerate(rests):
        own = [*range(a, b), *[b - 1] * (R - (b - a))]
        queries.extend(own)
        # a group without a prefix: its prefix cells are masked out (any position will do)
        keys.extend([*range(pa, pb), *[max(pb - 1, a)] * (P - (pb - pa)), *own])
        seen.append([True] * (pb - pa) + [False] * (P - (pb - pa)))
        for t in range(a, b):
            pick[t] = len(prefixes) * P + n * R + (t - a)
    causal = torch.ones(R, R, dtype=torch.bool).tril()
    prefix_seen = torch.tensor(seen, dtype=torch.bool).view(len(rests), 1, P)  # (C, 1, P)
    mask = torch.cat([prefix_seen.expand(-1, R, -1), causal.expand(len(rests), -1, -1)], dim=2)

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device)

    return TreeLayout(tensor(queries), tensor(keys), len(prefixes), P,
                      mask.unsqueeze(1).to(device), R, tensor(pick))


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   tree: tuple[tuple[int, ...], ...], scaling: float | None, gqa: bool,
                   dropout: float = 0.0) -> torch.Tensor:
    """Attention over groups whose rows share a prefix: q (1, Hq, T, D), k and v (1, Hkv, T,
    D) in; (1, T, Hq, D) out. The prefixes attend causally to themselves, side by side in one
    SDPA call (no mask); each row's rest, side by side in a second call, attends its group's
    prefix and itself causally (a mask of the prefix's real cells and a causal block): the
    attention each row gets alone, prefix included, with no arithmetic across groups. The
    queries are read in one gather for both calls, the keys and values in another (their heads
    side by side): each op here runs once per layer, forward and backward, and on a GPU their
    dispatch is the cost."""
    lay = tree_layout(tuple(tree), query.device)
    P, R, Gp = lay.longest_prefix, lay.longest_rest, lay.prefixes
    heads = (key.shape[1], value.shape[1])
    q_pre, q_rest = query[0].index_select(1, lay.queries).split(
        (Gp * P, lay.queries.numel() - Gp * P), dim=1)  # (Hq, cells, D) each
    kv_pre, kv_rest = torch.cat((key, value), dim=1)[0].index_select(1, lay.keys).split(
        (Gp * P, lay.keys.numel() - Gp * P), dim=1)  # (2·Hkv, cells, D) each

    def side_by_side(t: torch.Tensor, width: int) -> torch.Tensor:
        return t.unflatten(1, (-1, width)).transpose(0, 1)  # (H, cells, D) -> (rows, H, width, D)

    outs = []
    if P:
        k_pre, v_pre = side_by_side(kv_pre, P).split(heads, dim=1)
        out = F.scaled_dot_product_attention(
            side_by_side(q_pre, P), k_pre, v_pre,
            dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)  # (Gp, Hq, P, D)
        outs.append(out.transpose(1, 2).flatten(0, 1))
    k_rest, v_rest = side_by_side(kv_rest, P + R).split(heads, dim=1)
    out = F.scaled_dot_product_attention(
        side_by_side(q_rest, R), k_rest, v_rest,
        attn_mask=lay.mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa)  # (C, Hq, R, D)
    outs.append(out.transpose(1, 2).flatten(0, 1))
    return torch.cat(outs).index_select(0, lay.pick).unsqueeze(0)  # (1, T, Hq, D)


def fused_applies(query: torch.Tensor) -> bool:
    """Whether ``fused_varlen`` runs this call: CUDA, half precision, torch's kernel present."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
            and varlen_kernel() is not None)


@functools.cache
def varlen_kernel():
    """torch's ``varlen_attn`` and whether it takes ``enable_gqa`` and ``window_size`` (added
    after its first release, which took ``is_causal``), or None where torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "enable_gqa" in params, "window_size" in params


@functools.lru_cache(maxsize=64)
def cumulative(bounds: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int]:
    """The kernel's ``cu_seq`` (int32 on ``device``) and the longest sequence, for ``bounds``
    (cached: every layer of a forward, and its recomputation, asks for the same)."""
    longest = max(b - a for a, b in itertools.pairwise(bounds))
    return torch.tensor(bounds, dtype=torch.int32, device=device), longest


def fused_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 bounds: tuple[int, ...], scaling: float | None, gqa: bool) -> torch.Tensor:
    """Causal attention within each ``bounds`` slice in one ``varlen_attn`` call: q (1, Hq, T,
    D), k and v (1, Hkv, T, D) in; (1, T, Hq, D) out, as ``varlen_sdpa`` returns."""
    kernel = varlen_kernel()
    assert kernel is not None
    varlen_attn, takes_gqa, takes_window = kernel
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    if gqa and not takes_gqa:  # each kv head repeated for its group of query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu, longest = cumulative(tuple(bounds), q.device)
    options: dict = {"scale": scaling}
    options.update({"window_size": (-1, 0)} if takes_window else {"is_causal": True})
    if gqa and takes_gqa:
        options["enable_gqa"] = True
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest,
                      **options)
    return out.unsqueeze(0)  # (1, T, Hq, D)


def register() -> None:
    """Make ``flowrl_varlen`` a name transformers accepts (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, varlen_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # padded rows: SDPA's masks


def choose(model: torch.nn.Module, device: torch.device) -> str:
    """Switch ``model`` to the packed-friendly implementation for ``device``: flash-attention 2
    on CUDA where the ``flash_attn`` package is installed, ``flowrl_varlen`` otherwise. Returns
    the name chosen."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        name = "flash_attention_2"
    else:
        register()
        name = NAME
    model.set_attn_implementation(name)
    return name


def packed_call(config, input_ids: torch.Tensor, position_ids: torch.Tensor,
                tree: tuple[tuple[int, ...], ...] = ()) -> dict:
    """The keyword arguments of a transformers forward over one packed row (1, T).
    ``position_ids`` is (1, T), or (4, 1, T) for M-RoPE models (text positions first, then
    the three rotary rows: transformers' packed form for them). ``tree``: the row's groups
    with shared prefixes (``PackedRows.tree``), which only ``flowrl_varlen`` attends by."""
    if tree and shares(tree):
        if config._attn_implementation != NAME:
            raise ValueError(f"shared prefixes need the {NAME} attention, not "
                             f"{config._attn_implementation} (learner.share_prefixes = false)")
        return dict(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                    attention_mask=torch.ones_like(input_ids), flowrl_tree=tree)
    if config._attn_implementation != NAME:
        return dict(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    text = position_ids[0] if position_ids.dim() == 3 else position_ids  # (1, T)
    starts = (text[0] == 0).nonzero().flatten().tolist()  # each sequence starts at 0
    bounds = (*starts, text.shape[1])
    # an all-ones mask: transformers' SDPA mask then reduces to none (no (T, T) mask is built)
    return dict(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                attention_mask=torch.ones_like(input_ids), flowrl_bounds=bounds)
