"""``[model]``: the policy's weights and tokenizer."""

from __future__ import annotations

from typing import Literal

from actors.runtime.config.constraints import ModelPath
from actors.runtime.config.schema_base import _Section


class ModelConfig(_Section, frozen=True):
    path: ModelPath = "default"
    """Local Hugging Face model directory, or ``default`` for the embedded SmolLM2-135M-Instruct."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for sampling and training (float32 is the fast choice on CPUs)."""
    freeze_vision: bool = False
    """A vision-language model: train its language model only, the vision tower (and its
    merger) frozen. Off by default, as in verl and TRL: a reward that depends on what the image
    shows may need the tower to learn to see it; on, it saves the tower's gradients and
    optimizer state (prime-rl's default)."""
