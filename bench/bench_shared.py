"""The learner's step with each group's prompt computed once, against whole rows and a commit.

Against rows packed whole in this tree, and against an earlier commit's learner.

    python bench/bench_shared.py                      # the default job's batch and model
    python bench/bench_shared.py --shape long         # 512-token prompts, 64-token responses
    python bench/bench_shared.py --shape long --layers 4 --groups 1
    python bench/bench_shared.py --before ea1e1f2     # and that commit's learner beside them

Each side is one learner (``actors/learner/trainer.py``) in a process of its own, trained on
the same batches; the sides take each step in turn, the first side changing step by step (so a
change in the machine's load falls on all of them), and only one computes at a time. Sides:
``shared`` (``learner.share_prefixes`` true, the default), ``whole`` (false) and, with
``--before REV``, ``before``: the learner of commit ``REV`` with its own defaults, run from a
git worktree of it (its code builds the same batches from the same seeds). ``default`` is the
default job's batch (its first ``learner.groups_per_step`` prompts of the arithmetic task with
the chat template, ``n`` = 8 responses each, random tokens of 8 to ``sampler.max_tokens``
long), ``long`` a prompt-heavy one (random 512-token prompts, 64-token responses, 8 per
prompt). Printed per side: the median of ``timing_s/update_actor`` (the forward, backward and
optimizer passes) and of the whole step's ``timing_s/step`` from the second step on, the tokens
through the model per step, and the ratios against ``shared``; the dense arithmetic of a forward
and backward is ``6 · parameters · tokens``, so the tokens' ratio is the FLOPs' (attention and
the LM head aside). The load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from shaped_model import shaped_model  # noqa: E402 - bench/ is put on the path above

N = 8  # samples per prompt
REPLY = "@@ "  # a side's answer to a step, one JSON line; its other output is the learner's


def groups_of(root: Path, model: Path, shape: str, count: int | None, seed: int) -> list:
    """The batch's scored groups: prompts, random responses, behaviour log-probs of 0."""
    import torch

    from actors.data.chat import ChatTokenizer
    from actors.data.sources import make_task
    from actors.job.config.load import load_topology
    from actors.runtime.tensors import to_wire
    from messages.rollout import Prompt, Sample, SamplingParams, ScoredGroup

    topo = load_topology(root / "topology.toml")
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


def serve(args: argparse.Namespace) -> None:
    """One side: a learner of the tree at ``args.serve``, a step per seed read from stdin."""
    root = Path(args.serve)
    sys.path.insert(0, str(root))  # this side's tree before the bench's own
    import torch
    from transformers.utils import logging as hf_logging

    from actors.job.config.load import apply_overrides, decode_topology
    from actors.learner import packing
    from actors.learner.trainer import Trainer

    # a commit before the learner left each row's last token out reads every token
    read = getattr(packing, "read_lengths", list)
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    trainer = Trainer(decode_topology(apply_overrides({}, [
        f"model.path={args.model}", "algorithm.n=8",
        f"learner.groups_per_step={args.groups or 4}", *args.set])), Path(args.run))
    for line in sys.stdin:
        groups = groups_of(root, Path(args.model), args.shape, args.groups or None, int(line))
        m = trainer.train_step(groups)
        tokens = sum(read([g.prompt_ids.shape[0] + s.response_ids.shape[0]
                           for g in groups for s in g.samples]))
        print(REPLY + json.dumps({"update": m["timing_s/update_actor"],
                                  "step": m["timing_s/step"],
                                  "tokens": tokens - m.get("perf/shared_prefix_tokens", 0.0)}),
              flush=True)


class Side:
    """A side's process, asked for one step at a time."""

    def __init__(self, name: str, root: Path, overrides: list[str], model: Path, run: Path,
                 args: argparse.Namespace) -> None:
        self.name, self.seen = name, []
        command = [sys.executable, __file__, "--serve", str(root), "--model", str(model),
                   "--run", str(run), "--shape", args.shape, "--groups", str(args.groups),
                   "--threads", str(args.threads), *[f"--set={o}" for o in overrides]]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=root)

    def step(self, seed: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{seed}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                self.seen.append(json.loads(line[len(REPLY):]))
                return
        raise RuntimeError(f"side {self.name!r} ended (exit {self.proc.wait()}) before "
                           f"answering step {len(self.seen) + 1}; its error is above")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def worktree(rev: str, where: Path) -> Path:
    """A detached git worktree of commit ``rev`` of this checkout, at ``where``."""
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet",
                            f"{rev}^{{commit}}"], capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--before {rev}: not a commit of this checkout ({ROOT}); it needs "
                         "a git clone with that commit")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet",
                    str(where), found.stdout.strip()], check=True)
    return where


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["default", "long"], default="default")
    p.add_argument("--layers", type=int, default=0, help="decoder layers of the default model's "
                   "shape with random weights (0: the default model itself)")
    p.add_argument("--groups", type=int, default=0, help="prompts per step (0: the default job's)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--before", metavar="REV", help="a commit whose learner runs beside, as "
                   "it was (its defaults)")
    p.add_argument("--serve", help=argparse.SUPPRESS)  # a side's process: its tree
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args)

    from transformers.utils import logging as hf_logging

    from actors.model_store import resolve_model_path

    hf_logging.disable_progress_bar()
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as tmp:
        model = (shaped_model(Path(tmp) / "model", layers=args.layers) if args.layers
                 else resolve_model_path("default"))
        trees = [("shared", ROOT, ["learner.share_prefixes=true"]),
                 ("whole", ROOT, ["learner.share_prefixes=false"])]
        if args.before:
            trees.append(("before", worktree(args.before, Path(tmp) / "before"), []))
        sides = [Side(name, root, sets, model, Path(tmp) / f"run-{name}", args)
                 for name, root, sets in trees]
        try:
            for step in range(args.steps):
                for side in sides[step % len(sides):] + sides[:step % len(sides)]:
                    side.step(step)
        finally:
            for side in sides:
                side.close()
            if args.before:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(Path(tmp) / "before")], check=False)
    what = f"{args.layers} layers of the default model" if args.layers else "the default model"
    before = f"; before: {args.before}" if args.before else ""
    print(f"{args.shape} batch, {what}, {args.threads} threads, median of steps 2-{args.steps}"
          f"{before}:")
    rows = {}
    for side in sides:
        update = statistics.median(m["update"] for m in side.seen[1:])
        step_s = statistics.median(m["step"] for m in side.seen[1:])
        tokens = statistics.median(m["tokens"] for m in side.seen)
        rows[side.name] = update, step_s, tokens
        updates = " ".join(f"{m['update']:.3f}" for m in side.seen)
        print(f"  {side.name:<7} update {update:7.3f} s  step {step_s:7.3f} s  {tokens:7.0f} "
              f"tokens through the model  (updates: {updates})")
    u1, s1, t1 = rows["shared"]
    for name, (u0, s0, t0) in rows.items():
        if name != "shared":
            print(f"  shared against {name}: update {u0 / u1:.2f}x faster, step {s0 / s1:.2f}x, "
                  f"{t0 / t1:.2f}x fewer tokens (the dense FLOPs' ratio)")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
