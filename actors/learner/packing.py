"""Micro-batches by a token budget, and their sequences packed into one row without padding.

A micro-batch is a run of contiguous rows of the batch (``micro_batches``): at most
``learner.micro_batch_size`` sequences and, when ``learner.max_tokens_per_micro_batch`` is set,
at most that many tokens (prompt + response, padding not counted). A sequence longer than the
budget is never split nor dropped: it is a micro-batch of its own (the budget is a target, not a
limit the batch must meet). With several ranks every rank must run as many forward passes (FSDP's
collectives pair them), so each rank's split is refined to the largest count any rank needs; every
rank holds the whole batch, so each computes that count alone, without a collective.

Packed (``learner.packing``, the default), a micro-batch's sequences are concatenated into one
row of ``T = Σ (L_i - 1)`` tokens (a row's last token is left out: its output would predict
past the row's end, and nothing else reads it) with position ids restarting at 0 for each
sequence, and the model attends within each sequence only (``kernels/varlen_attention.py``):
flash-attention's varlen kernel on CUDA where it is installed, else ``flowrl_varlen``:
torch's ``varlen_attn`` on CUDA in half precision, elsewhere SDPA over the sequences side by
side or once per sequence (the reference for it is transformers' own packed path, a
block-diagonal ``(T, T)`` mask built from the position ids, and each sequence run alone). Only the model's forward changes: its outputs
are read back into the padded ``(B, W-1)`` layout (``PackedRows.index``), where every loss,
aggregation, correction and advantage is computed exactly as on the padded path (the reference,
kept behind ``learner.packing = false``; ``tests/test_packing.py`` compares the two).

Shared prefixes (``learner.share_prefixes``, on by default with packing): consecutive rows of a
group that begin with the same tokens (its prompt, and any identical start of the responses)
put those tokens in the packed row once, followed by each row's own rest, whose positions
continue from the prefix's end. Each rest attends to the prefix and to itself only
(``kernels/varlen_attention.py``: ``flowrl_tree``), so every hidden state equals the unshared
one and ``index`` maps each row's prefix columns to the one copy: the prefix's tokens take
their gradient from every row that reads them, as when each row carried its own. A group of
8 samples of a 29-token prompt with 17-token responses is 157 tokens instead of 360.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_ROWS, CPU_TOKENS, GPU_TOKENS = 8, 8192, 32768  # the "auto" limits of a micro-batch
CPU_ACTIVATIONS = 1 << 30  # bytes of saved activations a packed micro-batch holds on a CPU (auto)


def micro_limits(learner, cuda: bool, token_bytes: int = 0) -> tuple[int, int]:
    """``(max_rows, max_tokens)`` of a micro-batch from ``learner.micro_batch_size`` and
    ``learner.max_tokens_per_micro_batch``, their ``auto`` resolved for the device: a GPU is
    kept busy by few large micro-batches (a packed one has no row cap there, the token budget
    decides); on a CPU a packed micro-batch holds the tokens whose saved activations fit
    ``CPU_ACTIVATIONS`` (``token_bytes``: one token's, ``memory.token_activation_bytes``): about
    14 sequences of the default job, the whole batch of a thin model, whose every micro-batch
    costs the same ops' dispatch for little arithmetic. Without ``token_bytes``, or padded, a
    CPU takes 8 rows."""
    packed_cpu = not cuda and learner.packing and token_bytes > 0
    rows = learner.micro_batch_size
    if rows == "auto":
        rows = 1 << 30 if learner.packing and (cuda or packed_cpu) else CPU_ROWS
    tokens = learner.max_tokens_per_micro_batch
    if tokens == "auto":
        tokens = GPU_TOKENS if cuda else \
            min(CPU_TOKENS, max(1, CPU_ACTIVATIONS // token_bytes)) if packed_cpu else CPU_TOKENS
    return rows, tokens


def keep_whole(learner, cuda: bool, tokens: int) -> int:
    """The tokens up to which a group sharing its prompt stays one micro-batch over the token
    budget ``tokens`` (``micro_batches``' ``keep``): twice it under the CPU's ``auto``, where
    the budget is a soft target (``CPU_ACTIVATIONS``) and a cut computes the prompt again;
    else 0, the budget holding."""
    return 2 * tokens if not cuda and learner.max_tokens_per_micro_batch == "auto" else 0


def micro_batches(lengths: list[int], lo: int, hi: int, max_rows: int, max_tokens: int,
                  groups: list[tuple[list[int], int]] | None = None, keep: int = 0
                  ) -> list[slice]:
    """Rows ``[lo, hi)`` cut into contiguous micro-batches of at most ``max_rows`` rows and,
    when ``max_tokens > 0``, at most ``max_tokens`` tokens (``lengths[i]``: row i's tokens); a
    row longer than ``max_tokens`` is a micro-batch alone.

    ``groups``: the rows' shared-prefix groups (``share_groups``, ``lengths`` then being
    ``own_tokens``), read under a token budget only (a row cap alone cuts by rows, as the
    padded path and verl's micro-batches do). A group is cut only when it alone is over the
    limits: a micro-batch that starts inside a group holds that group's prefix again (its
    tokens counted here), computing it twice. ``keep``: a group of at most that many tokens
    stays whole even over the budget, a micro-batch of its own (where the budget is a soft
    target, not the device's memory: the CPU's ``auto``)."""
    out: list[slice] = []
    start, tokens = lo, 0

    def fits(rows: int, count: int) -> bool:
        return rows <= max_rows and (max_tokens <= 0 or count <= max_tokens)

    units = [([i for i in g if lo <= i < hi], common) for g, common in groups
             if any(lo <= i < hi for i in g)] if groups and max_tokens > 0 else \
        [([i], 0) for i in range(lo, hi)]
    for rows, common in units:
        size = sum(lengths[i] for i in rows)
        if rows[0] > start:  # joins the open micro-batch, or closes it
            if fits(rows[0] - start + len(rows), tokens + size):
                tokens += size
                continue
            out.append(slice(start, rows[0]))
            start, tokens = rows[0], 0
        if fits(len(rows), size) or (len(rows) <= max_rows and size <= keep):
            tokens = size
            continue
        for i in rows:  # over the limits alone: cut by rows, each later part with the prefix
            if i > start and not fits(i - start + 1, tokens + lengths[i]):
                out.append(slice(start, i))
                start, tokens = i, common
            tokens += lengths[i]
    if hi > start:
        out.append(slice(start, hi))
    return out


def packed_tokens(lengths: list[int], slices: list[slice],
                  groups: list[tuple[list[int], int]] | None) -> int:
    """The tokens micro-batches ``slices`` put through the model: each row's own
    (``own_tokens``), and a group's prefix again where a micro-batch starts inside the group."""
    again = {i: common for g, common in groups or () for i in g[1:]}
    return sum(sum(lengths[sl]) + again.get(sl.start, 0) for sl in slices)


def read_lengths(lengths: list[int]) -> list[int]:
    """The tokens of each row (of ``lengths`` tokens) the model reads: all but its last, whose
    output would predict past the row's end, so no log-prob, entropy or value reads it and no
    other token attends to it (a row of one token keeps it)."""
    return [n - 1 if n > 1 else n for n in lengths]


def share_groups(lengths: list[int], shared: tuple[int, ...]) -> list[tuple[list[int], int]]:
    """The rows' groups as ``pack`` shares them (``lengths``: each row's tokens), each with the
    prefix its rows share: the least of its rows' ``shared`` values, at most all but one of the
    tokens its shortest row has read (so each row keeps a rest of its own); a row with
    ``shared`` 0, and the first row, start a group."""
    groups: list[list[int]] = []
    for i in range(len(lengths)):
        if i == 0 or shared[i] == 0:
            groups.append([i])
        else:
            groups[-1].append(i)
    read = read_lengths(lengths)
    return [(g, max(0, min(min((shared[i] for i in g[1:]), default=0),
                           min(read[i] for i in g) - 1))) for g in groups]


def own_tokens(lengths: list[int], shared: tuple[int, ...]) -> list[int]:
    """The tokens each row (of ``lengths`` tokens) adds to a packed row: those the model reads
    (``read_lengths``), less the prefix of its group as ``pack`` shares it for every row but the
    group's first (``shared``: ``pack``'s; (): each row whole)."""
    out = read_lengths(lengths)
    if any(shared[1:]):
        for group, common in share_groups(lengths, shared):
            for j in group[1:]:
                out[j] -= common
    return out


def refine(parts: list[slice], lengths: list[int], count: int) -> list[slice]:
    """``parts`` split further until there are ``count`` of them (so that every rank runs as many
    micro-batches): the part of most tokens that has two rows or more is halved by tokens."""
    parts = list(parts)
    while len(parts) < count:
        splittable = [p for p in parts if p.stop - p.start > 1]
        if not splittable:
            raise ValueError(f"cannot cut {len(parts)} micro-batches into {count}: too few rows")
        p = max(splittable, key=lambda s: sum(lengths[s.start:s.stop]))
        half, run, cut = sum(lengths[p]) / 2, 0, p.start + 1
        for i in range(p.start, p.stop - 1):
            run += lengths[i]
            cut = i + 1
            if run >= half:
                break
        at = parts.index(p)
        parts[at:at + 1] = [slice(p.start, cut), slice(cut, p.stop)]
    return parts


@dataclass
class PackedRows:
    """The rows of a (padded) micro-batch packed into one row of ``T`` tokens."""

    input_ids: torch.Tensor  # (1, T) long, the sequences back to back
    position_ids: torch.Tensor  # (1, T) long, restarting at 0 for each sequence (group)
    offsets: torch.Tensor  # (B,) long, where row i's own tokens start, minus its shared prefix
    lengths: torch.Tensor  # (B,) long, row i's tokens read (``read_lengths``)
    source: torch.Tensor  # (T,) long, each packed token's place in input_ids.flatten() (what
    # a vision-language model's positions and images are read by)
    # shared prefixes: each group as (start, prefix end, end of each row's rest...) in the
    # packed row, and per row its prefix's length and where that prefix starts; () and None:
    # no row shares (every sequence is a group of one, its whole self the rest)
    tree: tuple[tuple[int, ...], ...] = ()
    prefix: torch.Tensor | None = None  # (B,) long
    heads: torch.Tensor | None = None  # (B,) long

    def index(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index, valid)``, each (B, width): the packed position of column ``t`` of row ``i``
        (``offsets[i] + t``, or in its group's prefix ``heads[i] + t``, clamped into the row)
        and whether it is one of row i's tokens."""
        cols = torch.arange(width, device=self.offsets.device)  # (width,)
        valid = cols.unsqueeze(0) < self.lengths.unsqueeze(1)  # (B, width)
        index = self.offsets.unsqueeze(1) + cols
        if self.prefix is not None and self.heads is not None:
            index = torch.where(cols.unsqueeze(0) < self.prefix.unsqueeze(1),
                                self.heads.unsqueeze(1) + cols, index)
        return index.clamp(0, self.input_ids.shape[1] - 1), valid

    def unpack(self, packed: torch.Tensor, width: int) -> torch.Tensor:
        """Per-position values ``packed`` (T, ...) in the padded layout (B, width, ...), 0 on
        the columns past each row's end."""
        index, valid = self.index(width)
        out = packed[index]  # (B, width, ...)
        shape = valid.shape + (1,) * (out.dim() - 2)
        return out * valid.view(shape).to(out.dtype)


def read_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, W) bool: the tokens of right-padded rows the model reads (``read_lengths``), without
    a host sync."""
    lengths = attention_mask.sum(1, keepdim=True)  # (B, 1)
    cols = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return cols < torch.where(lengths > 1, lengths - 1, lengths)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor,
         shared: tuple[int, ...] = (), lengths: tuple[int, ...] = ()) -> PackedRows:
    """Right-padded rows ``input_ids`` (B, W) with ``attention_mask`` (B, W), packed.

    ``shared[i]``: the leading tokens row i has in common with row i - 1 (0: it starts a
    group; ``RolloutBatch.shared``); () packs every row whole. Each group's rows share the
    prefix ``share_groups`` gives. ``lengths``: each row's tokens on the host
    (``RolloutBatch.lengths``; (): read from ``attention_mask``, a host sync on a GPU)."""
    if not any(shared[1:]):
        keep = read_mask(attention_mask)  # (B, W)
        read = keep.sum(1)  # (B,)
        offsets = torch.cumsum(read, 0) - read  # (B,)
        cols = torch.arange(input_ids.shape[1], device=input_ids.device)
        row_positions = cols.expand_as(input_ids)[keep]  # (T,) 0.. for each row
        cells = torch.arange(input_ids.numel(), device=input_ids.device).view_as(input_ids)
        return PackedRows(input_ids=input_ids[keep].unsqueeze(0),
                          position_ids=row_positions.unsqueeze(0), offsets=offsets,
                          lengths=read, source=cells[keep])
    rows, width = input_ids.shape
    whole = list(lengths) or attention_mask.sum(1).tolist()
    read = read_lengths(whole)
    flat: list[int] = []  # where each packed token is in input_ids.flatten()
    positions: list[int] = []
    tree: list[tuple[int, ...]] = []
    offsets, prefix, heads = [0] * rows, [0] * rows, [0] * rows
    for group, common in share_groups(whole, shared):
        start = len(flat)
        head = group[0] * width
        flat.extend(range(head, head + common))
        positions.extend(range(common))
        ends = [start, start + common]
        for i in group:
            offsets[i], prefix[i], heads[i] = len(flat) - common, common, start
            flat.extend(range(i * width + common, i * width + read[i]))
            positions.extend(range(common, read[i]))
            ends.append(len(flat))
        tree.append(tuple(ends))
    device = input_ids.device

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    source = tensor(flat)
    return PackedRows(input_ids=input_ids.flatten()[source].unsqueeze(0),
                      position_ids=tensor(positions).unsqueeze(0), offsets=tensor(offsets),
                      lengths=tensor(read), source=source, tree=tuple(tree),
                      prefix=tensor(prefix), heads=tensor(heads))
