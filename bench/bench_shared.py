"""The learner's step with each group's prompt computed once against each row packed whole.

    python bench/bench_shared.py                      # the default job's batch and model
    python bench/bench_shared.py --shape long         # 512-token prompts, 64-token responses
    python bench/bench_shared.py --shape long --layers 4 --groups 1

Trains one learner (``actors/learner/trainer.py``, in this process) per side on the same
batches, ``learner.share_prefixes`` true and false, the sides alternating step by step (so a
change in the machine's load falls on both): ``default`` is the default job's batch (its first
``learner.groups_per_step`` prompts of the arithmetic task with the chat template, ``n`` = 8
responses each, random tokens of 8 to ``sampler.max_tokens`` long), ``long`` a prompt-heavy
one (random 512-token prompts, 64-token responses, 8 per prompt). Printed per side: the
median of ``timing_s/update_actor`` (the forward, backward and optimizer passes) and of the
whole step's ``timing_s/step`` from the second step on, the tokens through the model per step,
and the ratios; the dense arithmetic of a forward and backward is ``6 · parameters · tokens``,
so the tokens' ratio is the FLOPs' (attention aside). The load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from shaped_model import shaped_model  # noqa: E402 - bench/ is put on the path above

N = 8  # samples per prompt
KEY = "timing_s/update_actor"


def groups_of(model: Path, shape: str, count: int | None, seed: int) -> list:
    """The batch's scored groups: prompts, random responses, behaviour log-probs of 0."""
    import torch

    from actors.data.chat import ChatTokenizer
    from actors.data.sources import make_task
    from actors.job.config.load import load_topology
    from actors.runtime.tensors import to_wire
    from messages.rollout import Prompt, Sample, SamplingParams, ScoredGroup

    topo = load_topology(ROOT / "topology.toml")
    gen = torch.Generator().manual_seed(seed)
    count = count or topo.learner.groups_per_step
    if shape == "default":
        tok, task = ChatTokenizer(model), make_task(topo.task, seed=0)
        prompts = [tok.prompt_ids(task.prompt(i, i).messages) for i in range(count)]
        lo, hi = 8, topo.sampler.max_tokens
    else:
        prompts = [torch.randint(100, 40000, (512,), generator=gen).tolist() for _ in range(count)]
        lo = hi = 64
    sampling = SamplingParams(temperature=1.0, max_tokens=hi)
    out = []
    for g, prompt in enumerate(prompts):
        samples = []
        for i in range(N):
            length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
            resp = torch.randint(100, 40000, (length,), generator=gen, dtype=torch.int32)
            samples.append(Sample(to_wire(resp), to_wire(torch.zeros(length)), 0, "", "stop",
                                  reward=float((i + g) % 2)))
        out.append(ScoredGroup(Prompt(g, [], "bench", ""), to_wire(torch.tensor(
            prompt, dtype=torch.int32)), samples, "s", sampling=sampling))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["default", "long"], default="default")
    p.add_argument("--layers", type=int, default=0, help="decoder layers of the default model's "
                   "shape with random weights (0: the default model itself)")
    p.add_argument("--groups", type=int, default=0, help="prompts per step (0: the default job's)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()

    import torch
    from transformers.utils import logging as hf_logging

    from actors.job.config.load import apply_overrides, decode_topology
    from actors.learner.packing import read_lengths
    from actors.learner.trainer import Trainer
    from actors.model_store import resolve_model_path

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as tmp:
        model = (shaped_model(Path(tmp) / "model", layers=args.layers) if args.layers
                 else resolve_model_path("default"))
        trainers = {share: Trainer(decode_topology(apply_overrides({}, [
            f"model.path={model}", f"learner.share_prefixes={share}", "algorithm.n=8",
            f"learner.groups_per_step={args.groups or 4}"])), Path(tmp) / f"run-{share}")
            for share in ("true", "false")}
        seen: dict[str, list[dict]] = {share: [] for share in trainers}
        read: list[int] = []  # per step, the tokens the model reads of the rows packed whole
        for step in range(args.steps):
            groups = groups_of(model, args.shape, args.groups or None, seed=step)
            read.append(sum(read_lengths([g.prompt_ids.shape[0] + s.response_ids.shape[0]
                                          for g in groups for s in g.samples])))
            for share in (("true", "false") if step % 2 == 0 else ("false", "true")):
                seen[share].append(trainers[share].train_step(groups))
    what = f"{args.layers} layers of the default model" if args.layers else "the default model"
    print(f"{args.shape} batch, {what}, {args.threads} threads, median of steps 2-{args.steps}:")
    rows = {}
    for share, metrics in seen.items():
        update = statistics.median(m["timing_s/update_actor"] for m in metrics[1:])
        step = statistics.median(m["timing_s/step"] for m in metrics[1:])
        tokens = statistics.median(r - m["perf/shared_prefix_tokens"]
                                   for r, m in zip(read, metrics, strict=True))
        rows[share] = update, step, tokens
        print(f"  share_prefixes={share:<5}  update {update:7.3f} s  step {step:7.3f} s  "
              f"{tokens:7.0f} tokens through the model  (updates: "
              f"{' '.join(f'{m[KEY]:.3f}' for m in metrics)})")
    (u1, s1, t1), (u0, s0, t0) = rows["true"], rows["false"]
    print(f"  shared against whole: update {u0 / u1:.2f}x faster, step {s0 / s1:.2f}x, "
          f"{t0 / t1:.2f}x fewer tokens (the dense FLOPs' ratio)")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
