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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[:, :-1]).squeeze(-1).float()  # (B, W-1)

    def save(self, path: Path, state: dict[str, torch.Tensor]) -> None:
        """Write the whole ``state`` (this module's state dict, gathered when sharded)."""
        body = {k.removeprefix("body."): v for k, v in state.items() if k.startswith("body.")}
        self.body.save_pretrained(path, state_dict=body)  # the body itself is never wrapped
        torch.save({k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")},
                   path / "value_head.pt")
