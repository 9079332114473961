"""The embedded default model's shape with random weights, cut down where a bench asks.

``layers``: fewer decoder layers of the same width (the same per-layer work, less of it).
``hidden``: the thin model: every layer, the vocabulary, the tokenizer and the chat template
kept, the width cut to ``hidden`` (64: 4.3M parameters, a few percent of the arithmetic of a
step), so what a step costs is what it costs around its arithmetic: the Python, the ops'
dispatch, the messages and the weights' transfers that bound the 135M model's step on a GPU.

    python bench/shaped_model.py OUT_DIR [--layers N] [--hidden H]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

THIN = 64  # the thin model's width


def shaped_model(where: Path, *, layers: int | None = None, hidden: int | None = None,
                 seed: int = 0) -> Path:
    """Write the cut-down model (safetensors, config, tokenizer, chat template) into ``where``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from actors.model_store import resolve_model_path

    default = resolve_model_path("default")
    config = AutoConfig.from_pretrained(default)
    if layers is not None:
        config.num_hidden_layers = layers
    if hidden is not None:  # four heads of a quarter of the width, two KV heads (grouped as 2:1)
        config.hidden_size, config.intermediate_size = hidden, 2 * hidden
        config.num_attention_heads, config.num_key_value_heads = 4, 2
        config.head_dim = hidden // 4
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(where)
    AutoTokenizer.from_pretrained(default).save_pretrained(where)
    return where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    args = p.parse_args()
    shaped_model(args.out, layers=args.layers, hidden=args.hidden)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.out)
    print(f"{args.out}: {config.num_hidden_layers} layers, hidden {config.hidden_size}")


if __name__ == "__main__":
    main()
