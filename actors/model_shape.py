"""The weight count of a Llama/Qwen2-shaped decoder layer, and the width of one attention head,
from its config's numbers.

Torch-free: the runner sizes a weights version from them when a model directory has no
safetensors headers to sum (``job/config/capacity.py``), and the learner counts verl's dense
``N`` for its FLOPs from them (``learner/perf.py``): one rule read the same way by both.
"""

from __future__ import annotations


def layer_weights(hidden: int, intermediate: int, heads: int, kv_heads: int,
                  head_dim: int) -> int:
    """Weights of one decoder layer's matrices: the attention's q and o projections
    (``heads × head_dim`` wide), its k and v (``kv_heads × head_dim``: grouped-query attention
    shares them), and the SwiGLU MLP's gate, up and down (``hidden × intermediate`` each).
    Norms and biases are not matrices and are not counted."""
    return hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate


def head_width(hidden: int, heads: int, head_dim: int | None = None) -> int:
    """Width of one attention head: the config's ``head_dim`` when it sets one (Qwen3, Gemma:
    not always ``hidden // heads``), else the hidden size split among the heads."""
    return head_dim or hidden // heads
