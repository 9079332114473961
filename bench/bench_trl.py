"""The default job against TRL's GRPOTrainer on the same task, model and batch, side by side.

    python bench/bench_trl.py                                   # flowrl and TRL, 30 steps each
    python bench/bench_trl.py --model thin --steps 15 --ops     # the overhead: the thin model
    python bench/bench_trl.py --steps 10 --rounds 2 \\
        --run "flowrl" --run "flowrl learner.dtype=bfloat16 sampler.dtype=bfloat16" \\
        --run "trl" --run "trl bf16"

Each ``--run`` is ``flowrl [dotted overrides...]`` (``python runner.py topology.toml`` with them)
or ``trl [bf16] [cuda] [threads=N]`` (``cuda``: TRL on the GPU; default: as many torch threads as cores). They run one at a time, in the order given, ``--rounds`` times (interleaved:
on a shared machine, load that comes and goes then slows every run alike).

The same job on both sides: the embedded SmolLM2-135M-Instruct, the built-in arithmetic task
(same prompts: same system prompt, chat template and seed) scored by the same rule, 4 prompts ×
8 completions = 32 samples per optimizer step in micro-batches of 8, at most 24 new tokens at
temperature 1.0, AdamW at lr 1e-5, no KL term, PPO clip ε = 0.2. TRL's ``GRPOTrainer`` runs in
a child process (``torch`` threads = cores unless ``threads=N``), generating with transformers (no vLLM)
and then training, in turns; flowrl runs its actors as ``topology.toml`` places them (or as the
overrides say), without the default job's validation rounds (TRL runs none here;
``validation.every=10 validation.before_training=true`` as overrides put them back; both are
turned off, since ``validation.every=0`` alone leaves the step-0 round on).

``--model thin``: both sides train the thin model instead (``bench/shaped_model.py``: the
default's 30 layers, vocabulary, tokenizer and chat template, hidden 64, random weights), so a
step's arithmetic is a few percent of the default's and each side's step time is its own
overhead: the Python, the ops' dispatch, the messages and the weights' work that bound the
default job on a GPU. ``--ops`` adds a flowrl run of a few steps with one learner step and one
sampler batch under torch.profiler (not timed), and prints the torch ops dispatched per learner
step and per decoding step (``actors/runtime/profiling.py``'s count).

Time is the training loop's: from the moment flowrl's actors are all ready, or TRL's ``train()``
starts, to its last step (model loading and flowrl's final checkpoint are left out). Printed per
run: seconds, samples/s (``steps × 32 / seconds``), the CPU the whole job used over that time
(user + system seconds of every process of it per wall second: 2.00 is both cores busy), the
mean reward of the first and last 5 steps, and the load average before and after; for flowrl
also its step's parts (medians from step 3 on: the update, generation, the wait for the batch,
the publish, the samplers' load of the weights, the learner's own time between steps) and the
fixed cost per step (between steps plus the load; the publish runs beside the next step where
the learner is one rank on a host transport, else between steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SAMPLES_PER_STEP = 32


OPS_STEP = 4  # the step (and sampler batch) profiled by --ops: past the first ones' warm-up


def flowrl_ops(model: str) -> dict:
    """Torch ops dispatched by one learner step and per decoding step of one sampler batch, in a
    short flowrl run with those under the profiler (``learner.profile_steps``)."""
    with tempfile.TemporaryDirectory(prefix="bench-flowrl-ops-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "runner.py", "topology.toml", f"run.dir={run_dir}",
               f"model.path={model}", f"learner.total_steps={OPS_STEP + 1}",
               f"learner.save_every={OPS_STEP + 1}", "validation.every=0",
               "validation.before_training=false", "run.status_interval=0",
               f"learner.profile_steps=[{OPS_STEP}]", f"sampler.profile_batches=[{OPS_STEP}]"]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"flowrl --ops run failed ({res.returncode}):\n{res.stdout[-3000:]}")
        learner, sampler = (json.loads((run_dir / "profiles" / name / f"step_{OPS_STEP}.json")
                                       .read_text()) for name in ("learner-0", "sampler-0"))
        return {"learner_ops": learner["ops"], "learner_top": learner["ops_by_name"],
                "decode_ops": sampler["ops"] / max(sampler["decode_steps"], 1),
                "decode_top": sampler["ops_by_name"], "decode_steps": sampler["decode_steps"]}


def run_flowrl(overrides: list[str], steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-flowrl-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "runner.py", "topology.toml", f"run.dir={run_dir}",
               f"learner.total_steps={steps}", "run.status_interval=0",
               f"learner.save_every={steps}", "validation.every=0",
               "validation.before_training=false", *overrides]
        started = last = None
        cpu_start = cpu_end = 0.0
        ends: list[float] = []  # when each step's line came, seconds after the job started
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        tail = []
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = (tail + [line])[-40:]
            if line.startswith("=== job started"):
                started, cpu_start = time.monotonic(), tree_cpu_seconds(proc.pid)
            elif started is not None and line.startswith("step ") and f"/{steps}" in line:
                ends.append(time.monotonic() - started)
            if line.startswith(f"step {steps:>4}/{steps}"):
                last, cpu_end = time.monotonic(), tree_cpu_seconds(proc.pid)
        if proc.wait() != 0 or started is None or last is None:
            raise SystemExit(f"flowrl {' '.join(overrides)} failed ({proc.returncode}):\n"
                             + "".join(tail))
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {"seconds": last - started, "rewards": [r["critic/score/mean"] for r in rows],
                "cpu_seconds": cpu_end - cpu_start, "breakdown": breakdown(rows),
                "ends": ends, "steps_s": [r.get("timing_s/step", 0.0) for r in rows],
                "waits_s": [r.get("timing_s/wait_batch", 0.0) for r in rows]}


STEP_PARTS = ("update_actor", "gen", "wait_batch", "weight_publish", "weight_sync",
              "between_steps")


def breakdown(rows: list[dict]) -> dict[str, float]:
    """Medians from step 3 on of the step's parts (``timing_s/...``), and the fixed cost per
    step: the learner's own time between steps plus the samplers' load of the weights."""
    def median(key: str) -> float:
        values = sorted(r[key] for r in rows[2:] if key in r) or [0.0]
        return values[len(values) // 2]

    out = {part: median(f"timing_s/{part}") for part in STEP_PARTS}
    # between_steps holds the publish where it is not beside the next step (Learner.publish)
    out["fixed"] = out["between_steps"] + out["weight_sync"]
    return out


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of process ``root`` and every live descendant, including the
    children each of them has already reaped (their ``cutime``/``cstime``), from /proc: the
    difference of two readings is what the whole job computed in between."""
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue  # exited meanwhile
            stats[int(entry.name)] = text.rpartition(")")[2].split()
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: the parent's pid
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += sum(int(x) for x in stats[pid][11:15])  # utime stime cutime cstime
        todo.extend(children.get(pid, []))
    return total / os.sysconf("SC_CLK_TCK")


def run_trl(bf16: bool, threads: int, steps: int, cuda: bool = False, model: str = "default"
            ) -> dict:
    """TRL's GRPOTrainer in a child process (a fresh interpreter, like flowrl's actors)."""
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--trl-child", str(out), "--steps", str(steps),
               "--threads", str(threads), "--model", model]
        if bf16:
            cmd.append("--bf16")
        if cuda:
            cmd.append("--cuda")
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"trl failed ({res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
        return json.loads(out.read_text())


def trl_child(out: Path, steps: int, bf16: bool, threads: int, cuda: bool = False,
              model_path: str = "default") -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from actors.data.sources import make_task
    from actors.model_store import resolve_model_path
    from actors.runtime.config import TaskConfig
    from actors.scoring.rules import arithmetic_score

    torch.set_num_threads(threads)
    model = str(resolve_model_path(model_path))
    task = make_task(TaskConfig(name="arithmetic"), seed=0)
    rows = []
    for i in range(steps * 4 + 8):
        p = task.prompt(i, i)
        rows.append({"prompt": [{"role": m.role, "content": m.content} for m in p.messages],
                     "ground_truth": p.ground_truth, "a": p.extra_info["a"],
                     "b": p.extra_info["b"]})

    def reward(completions, ground_truth, a, b, **kwargs) -> list[float]:
        return [arithmetic_score("arithmetic", c[0]["content"], t, {"a": x, "b": y})
                for c, t, x, y in zip(completions, ground_truth, a, b, strict=True)]

    config = GRPOConfig(
        output_dir=str(out.parent / "trl"), learning_rate=1e-5, per_device_train_batch_size=8,
        gradient_accumulation_steps=4, num_generations=8, max_completion_length=24,
        temperature=1.0, max_steps=steps, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=not cuda, bf16=bf16, beta=0.0, epsilon=0.2, seed=0, shuffle_dataset=False,
        disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(model))
    started, cpu = time.monotonic(), time.process_time()  # every thread of this process
    trainer.train()
    seconds = time.monotonic() - started
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    out.write_text(json.dumps({"seconds": seconds, "rewards": rewards,
                               "cpu_seconds": time.process_time() - cpu}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", help="flowrl [overrides...] | trl [bf16] [cuda]")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--model", default="default",
                   help="default (the embedded model), thin (its shape, hidden 64), or a path")
    p.add_argument("--ops", action="store_true",
                   help="also count flowrl's ops per learner step and per decoding step")
    p.add_argument("--trl-child", help=argparse.SUPPRESS)
    p.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--cuda", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_child:
        trl_child(Path(args.trl_child), args.steps, args.bf16, args.threads, args.cuda,
                  args.model)
        return
    with tempfile.TemporaryDirectory(prefix="bench-trl-model-") as tmp:
        model = args.model
        if model == "thin":
            sys.path.insert(0, str(ROOT / "bench"))
            from shaped_model import THIN, shaped_model

            model = str(shaped_model(Path(tmp) / "thin", hidden=THIN))
        compare(args, model)


def compare(args: argparse.Namespace, model: str) -> None:
    runs = args.run or ["flowrl", "trl"]
    print(f"{args.steps} steps × {SAMPLES_PER_STEP} samples per run; model {args.model}; "
          f"{os.cpu_count()} cores; load average at start {os.getloadavg()[0]:.2f}", flush=True)
    own = [] if model == "default" else [f"model.path={model}"]
    for rnd in range(args.rounds):
        for spec in runs:
            kind, *rest = spec.split()
            load = os.getloadavg()[0]
            threads = next((int(w.split("=")[1]) for w in rest if w.startswith("threads=")),
                           os.cpu_count() or 1)
            r = (run_trl("bf16" in rest, threads, args.steps, "cuda" in rest, model)
                 if kind == "trl" else run_flowrl([*own, *rest], args.steps))
            rewards = r["rewards"]
            first, last = sum(rewards[:5]) / len(rewards[:5]), sum(rewards[-5:]) / len(rewards[-5:])
            print(f"round {rnd + 1} | {spec:<40} | {r['seconds']:7.1f} s | "
                  f"{args.steps * SAMPLES_PER_STEP / r['seconds']:5.2f} samples/s | CPU "
                  f"{r['cpu_seconds'] / r['seconds']:4.2f} of {os.cpu_count()} | reward first 5 "
                  f"{first:.3f}, last 5 {last:.3f} | load {load:.1f} -> {os.getloadavg()[0]:.1f}",
                  flush=True)
            if "breakdown" in r:  # flowrl: its step's parts, medians of steps 3 on
                print("        per step (s): " + ", ".join(
                    f"{k} {v:.3f}" for k, v in r["breakdown"].items()), flush=True)
                # where the wall goes when it exceeds the medians: each step's own numbers
                print("        step ends (s after start): " + " ".join(
                    f"{t:.1f}" for t in r["ends"]), flush=True)
                print("        step s: " + " ".join(f"{t:.2f}" for t in r["steps_s"])
                      + " | wait s: " + " ".join(f"{t:.2f}" for t in r["waits_s"]), flush=True)

    if args.ops:
        ops = flowrl_ops(model)
        print(f"flowrl ops (profiled step {OPS_STEP}): {ops['learner_ops']:,} per learner step; "
              f"{ops['decode_ops']:,.0f} per decoding step ({ops['decode_steps']} steps in the "
              "batch)", flush=True)
        for what in ("learner", "decode"):
            top = sorted(ops[f"{what}_top"].items(), key=lambda kv: -kv[1])[:8]
            print(f"        {what} top: " + ", ".join(f"{k[6:]} {v}" for k, v in top), flush=True)


if __name__ == "__main__":
    main()
