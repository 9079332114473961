"""The learner's memory estimate (``actors/learner/memory.py``) for large model shapes, and a
check of it against torch's own numbers on this machine's CPU.

    python bench/bench_memory.py                 # 1.5B- and 7B-shape tables, one 141 GB GPU
    python bench/bench_memory.py --check         # the estimate against real tensors (CPU)

The shapes are built from configs (Qwen2-1.5B and Qwen2-7B, random weights, on the meta device:
nothing is downloaded). Each row is one rank of one GPU: float32 parameters and AdamW state,
bfloat16 compute (``learner.dtype = auto`` on a GPU), FSDP2 (a process group of one), layers
resharded after forward (the GPU default), no reference model (the default job has no KL term).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actors.learner.memory import (  # noqa: E402
    GB,
    HEADER,
    count_parameters,
    estimate,
    layer_activation_bytes,
    measured,
    saved_bytes,
)

GPU_GB = 141.0  # one H200
MARGIN_GB = 6.0  # CUDA context, allocator slack and the batch: not in the estimate; within
# 10% of the GPU the allocator's fragmentation can decide, so such a row is called tight


def shapes():
    from transformers import Qwen2Config

    return {
        "1.5B (Qwen2-1.5B shape)": Qwen2Config(
            vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
            num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
        "7B (Qwen2-7B shape)": Qwen2Config(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    }


def tables(tokens: list[int]) -> None:
    for name, config in shapes().items():
        counts = count_parameters(config)
        total = counts[0]
        print(f"\n{name}: {total / 1e9:.2f}B parameters; one rank, fp32 states, bf16 compute")
        print(f"{'tokens ckpt offload':>22} {HEADER}")
        for t in tokens:
            for ckpt, offload in ((True, False), (True, True), (False, False), (False, True)):
                e = estimate(config, tokens=t, world=1, param_bytes=4, compute_bytes=2,
                             offload=offload, checkpointing=ckpt, counts=counts)
                need = e.device_total / GB + MARGIN_GB
                verdict = ("fits" if need <= 0.9 * GPU_GB else
                           "tight (within 10%)" if need <= GPU_GB else "does not fit")
                print(f"{t:>8} {'on ' if ckpt else 'off':>5} {'on ' if offload else 'off':>7}  "
                      f"{e.row()}  {verdict} in {GPU_GB:.0f} GB")


def check() -> None:
    """One optimizer step of a small Qwen2-shaped model on packed tokens, float32 on the CPU:
    the estimate's states against the real tensors' bytes, its activations against the bytes
    of the tensors autograd saved (and, with checkpointing, the layer inputs it keeps)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from actors.learner.objective import _forward

    config = Qwen2Config(vocab_size=2048, hidden_size=512, intermediate_size=1408,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    for ckpt in (False, True):
        model = AutoModelForCausalLM.from_config(config).train()
        if ckpt:
            model.gradient_checkpointing_enable()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(3, 2000, (16, 64))
        tokens = ids.numel()  # the rows packed into one
        at = torch.ones(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)  # every next token
        keep = []

        def forward(at=at, ids=ids, model=model, keep=keep):
            keep.append(_forward(model, ids, torch.ones_like(ids), at, 1.0, False, False,
                                 True, None))
            return keep[-1]

        acts = saved_bytes(forward, list(model.parameters()))
        keep[-1].sum().backward()
        optimizer.step()
        real = measured(model, optimizer)
        e = estimate(config, tokens=tokens, checkpointing=ckpt)
        forward_part = e.activations - (tokens * layer_activation_bytes(config, 4) if ckpt else 0)
        print(f"\ncheckpointing {'on' if ckpt else 'off'}, {tokens} tokens, float32, CPU:")
        for key in ("parameters", "gradients", "optimizer"):
            print(f"  {key:<11} estimate {getattr(e, key) / 1e6:9.2f} MB   torch {real[key] / 1e6:9.2f} MB")
        print(f"  activations estimate {forward_part / 1e6:9.2f} MB   saved by autograd "
              f"{acts / 1e6:9.2f} MB (forward; the estimate adds "
              f"{(e.activations - forward_part) / 1e6:.2f} MB for the layer recomputed in backward)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384],
                   help="tokens per micro-batch (learner.max_tokens_per_micro_batch)")
    p.add_argument("--check", action="store_true", help="compare with torch's numbers on the CPU")
    args = p.parse_args()
    if args.check:
        check()
    else:
        tables(args.tokens)


if __name__ == "__main__":
    main()
