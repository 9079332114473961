"""Where a learner step of the default job's shape spends its time: CPU against GPU, by op.

    python bench/profile_learner.py --device cuda      # SmolLM2-135M shape, 30 layers
    python bench/profile_learner.py --device cpu       # 2 layers (a CPU is slow at 30)

Builds the embedded model's shape with random weights (no download), trains four steps on the
default job's batch shape (4 groups x 8 samples, ``bench_learner``'s random batches), prints
each step's seconds, then profiles a fifth step with ``torch.profiler`` and prints its ops by
CPU total and by self CPU time. A step whose CPU time far exceeds its GPU time is bound by
launching kernels, not by the GPU's arithmetic.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--layers", type=int, default=0, help="default: 30 on cuda, 2 on cpu")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. learner.packing=false")
    args = p.parse_args()

    import torch
    from bench_learner import batches
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    from actors.job.config.load import apply_overrides, decode_topology
    from actors.learner.trainer import Trainer
    from tests.tiny_model import tiny_tokenizer

    work = Path(tempfile.mkdtemp(prefix="profile-learner-"))
    layers = args.layers or (30 if args.device == "cuda" else 2)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(work / "model")
    tiny_tokenizer().save_pretrained(work / "model")
    topology = decode_topology(apply_overrides({}, [
        f"model.path={work / 'model'}", "model.dtype=float32", f"learner.device={args.device}",
        "algorithm.n=8", "learner.groups_per_step=4", *args.overrides]))
    trainer = Trainer(topology, work / "run")
    steps = batches(trainer, 6, 4, 8, 20, seed=0)

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    for i, batch in enumerate(steps[:4]):
        sync()
        start = time.perf_counter()
        trainer.train_step(batch)
        sync()
        print(f"step {i}: {time.perf_counter() - start:.3f} s", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        trainer.train_step(steps[4])
        sync()
    table = prof.key_averages()
    print(table.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
