"""A 1.5B-shape learner step's MFU over micro-batch and checkpointing settings, on one GPU.

    python bench/learner_mfu.py            # on a machine with a CUDA GPU

The model is ``bench/gpu_check.py``'s: a Qwen2 of 1.5B shape with random weights (bf16
compute, fp32 master weights, the default job's loss). Each setting trains one untimed step and
two timed ones on 4 groups x 8 samples of random responses (512 tokens, or 512-2,048), and
prints one JSON line: tokens per step, seconds per step, tokens/s, MFU (6 x parameters x
tokens/s against 989 bf16 TFLOP/s) and peak GPU memory. A setting that fails prints its error
and the others still run.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PEAK_FLOPS = 989e12  # H100/H200 dense bf16
SETTINGS = [  # (label, response tokens, shortest response or None, overrides)
    ("8 rows, 8192 tokens", 512, None,
     ["learner.micro_batch_size=8", "learner.max_tokens_per_micro_batch=8192"]),
    ("auto (no row cap, 32768 tokens)", 512, None, []),
    ("auto, no checkpointing", 512, None, ["learner.gradient_checkpointing=false"]),
    ("long: 8 rows, 8192 tokens", 2048, 512,
     ["learner.micro_batch_size=8", "learner.max_tokens_per_micro_batch=8192"]),
    ("long: 64 rows, 65536 tokens", 2048, 512,
     ["learner.micro_batch_size=64", "learner.max_tokens_per_micro_batch=65536"]),
]


def main() -> None:
    import torch
    from bench_learner import batches
    from gpu_check import Check

    from actors.learner.trainer import Trainer

    check = Check(False, Path(tempfile.mkdtemp(prefix="learner-mfu-")))
    groups, n = 4, 8
    for label, response, shortest, extra in SETTINGS:
        try:
            trainer = Trainer(check.topology(f"algorithm.n={n}", f"learner.groups_per_step={groups}",
                                             *extra), check.workdir / f"run{len(label)}")
            warm, *timed = batches(trainer, 3, groups, n, response, seed=0, min_response=shortest)
            trainer.train_step(warm)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for batch in timed:
                trainer.train_step(batch)
            torch.cuda.synchronize()
            seconds = (time.perf_counter() - start) / len(timed)
            tokens = sum(len(s.response_ids.data) // 4 + len(g.prompt_ids.data) // 4
                         for g in timed[0] for s in g.samples)
            params = sum(p.numel() for p in trainer.policy.model.parameters())
            row = dict(setting=label, tokens=tokens, s=round(seconds, 3),
                       tokens_per_s=round(tokens / seconds),
                       mfu=round(6 * params * tokens / seconds / PEAK_FLOPS, 4),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
            trainer.group.close()
            del trainer
            torch.cuda.empty_cache()
        except Exception as exc:  # one setting's failure (out of memory) is its row
            row = dict(setting=label, error=f"{type(exc).__name__}: {exc}"[:300])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
