"""The critic for GAE: the policy's architecture with a scalar value head, its own optimizer.

Like verl's critic it starts from the same checkpoint as the policy (the transformer body) with
a fresh linear head, and predicts at every position the value of the state before the next
token, aligned with the learner's next-token tensors (column ``t`` values the prefix up to ``t``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel

from actors.learner.batch import RolloutBatch
from actors.learner.packing import pack
from kernels.varlen_attention import packed_call


class ValueModel(nn.Module):
    """``weights=False`` builds the architecture only (a rank that receives rank 0's weights)."""

    def __init__(self, source: Path, dtype: torch.dtype, *, weights: bool = True) -> None:
        super().__init__()
        if weights:
            self.body = AutoModel.from_pretrained(source, dtype=dtype)
        else:
            self.body = AutoModel.from_config(AutoConfig.from_pretrained(source), dtype=dtype)
        self.head = nn.Linear(self.body.config.hidden_size, 1, dtype=dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        head_file = source / "value_head.pt"
        if weights and head_file.is_file():
            self.head.load_state_dict(torch.load(head_file))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None = None,
                tree: tuple[tuple[int, ...], ...] = ()) -> torch.Tensor:
        """Values (B, W-1) of right-padded rows; packed (``position_ids`` (1, T), no
        ``attention_mask``: ``actors/learner/packing.py``), the value at every position (1, T)."""
        if position_ids is None:
            hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return self.head(hidden[:, :-1]).squeeze(-1).float()  # (B, W-1)
        hidden = self.body(**packed_call(self.body.config, input_ids, position_ids,
                                         tree)).last_hidden_state
        return self.head(hidden).squeeze(-1).float()  # (1, T)

    def save(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        """Write the whole ``state`` (this module's state dict, gathered when sharded)."""
        body = {k.removeprefix("body."): v for k, v in state.items() if k.startswith("body.")}
        self.body.save_pretrained(path, state_dict=body)  # the body itself is never wrapped
        torch.save({k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")},
                   path / "value_head.pt")


def critic_values(critic, batch: RolloutBatch) -> torch.Tensor:
    """The critic's values (B, W-1) of ``batch``'s rows, read packed when the batch is (0 past
    each row's end then, where the padded path has values of padding: both are masked out)."""
    if not batch.packed:
        return critic(batch.input_ids, batch.attention_mask)
    rows = pack(batch.input_ids, batch.attention_mask, batch.shared, batch.lengths)
    return rows.unpack(critic(rows.input_ids, None, rows.position_ids, rows.tree)[0],
                       batch.response_mask.shape[1])
