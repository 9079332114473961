"""Learner step time and tokens/s: one rank against a group of ranks (FSDP2), same batches.

    python bench/bench_learner.py --ranks 1 2 --threads 1 --steps 4          # CPU, gloo
    python bench/bench_learner.py --ranks 1 --device cuda --dtype bfloat16   # one GPU
    python bench/bench_learner.py --ranks 1 --layouts packed padded --min-response 4 --response 24

Each configuration runs in fresh processes (``--ranks N``: N processes started the way the
runner starts learner ranks), builds the learner of the default job (``topology.toml``: the
embedded SmolLM2-135M-Instruct unless ``--model``), and takes ``--warmup`` untimed steps, then
``--steps`` timed ones on synthetic batches shaped like the default job's (``groups × n``
sequences of an arithmetic prompt plus ``--response`` random tokens). Rank 0 prints seconds per
step and learner tokens/s (prompt and response tokens per second of step time), and the CPU seconds
all ranks used per step (their compute and their collectives' copies: the figure background load
changes least), where the step's time went (``timing_s/update_actor`` and
the rest), and the padding share: the share of the padded micro-batches' cells (rows × their
longest sequence) that are padding, which the packed layout does not compute. ``--layouts``
runs each rank count packed (``learner.packing = true``) and padded (the reference path).
Configurations run one after another, in the order given, ``--rounds`` times, interleaved: on
a shared machine compare rounds, not a single number.
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


def batches(trainer, count: int, groups: int, n: int, response: int, seed: int,
            min_response: int | None = None):
    import torch

    from actors.data.chat import chat_ids
    from actors.runtime.tensors import to_wire
    from messages.rollout import ChatMessage, Prompt, Sample, SamplingParams, ScoredGroup

    gen = torch.Generator().manual_seed(seed)
    sampling = SamplingParams(temperature=1.0, max_tokens=response)
    vocab = trainer.policy.model.config.vocab_size
    out = []
    for b in range(count):
        batch = []
        for g in range(groups):
            a, c = (b * groups + g) % 9 + 1, (b + g) % 9 + 1
            ids = chat_ids(trainer.policy.tokenizer, [ChatMessage("user", f"What is {a} + {c}?")])
            samples = []
            for i in range(n):
                length = (response - (i % 4) if min_response is None else
                          int(torch.randint(min_response, response + 1, (1,), generator=gen)))
                resp = torch.randint(100, vocab - 1, (length,), generator=gen, dtype=torch.int32)
                lp = -torch.rand(length, generator=gen) * 3
                samples.append(Sample(to_wire(resp), to_wire(lp), b, "", "length",
                                      reward=float((i + g) % 3 == 0)))
            batch.append(ScoredGroup(Prompt(b * groups + g, [], "arithmetic", "0"),
                                     to_wire(torch.tensor(ids, dtype=torch.int32)), samples, "s",
                                     sampling=sampling))
        out.append(batch)
    return out


def rank_main(args) -> None:
    import torch

    from actors.job.config.load import load_topology
    from actors.learner.packing import micro_batches, micro_limits
    from actors.learner.policy import learner_group
    from actors.learner.trainer import Trainer
    from actors.runtime.ranks import Rank

    torch.set_num_threads(args.threads)
    overrides = [f"learner.device={args.device}", f"learner.dtype={args.dtype}",
                 f"learner.micro_batch_size={args.micro}", f"learner.packing={str(args.layout == 'packed').lower()}",
                 f"learner.max_tokens_per_micro_batch={args.max_tokens}",
                 f"learner.groups_per_step={args.groups}", f"algorithm.n={args.n}",
                 f"learner.nproc_per_node={Rank.from_env().world_size}",
                 f"model.path={args.model}", f"run.dir={args.run_dir}"]
    topo = load_topology(ROOT / "topology.toml", overrides)
    group = learner_group(topo, Rank.from_env())
    try:
        trainer = Trainer(topo, Path(args.run_dir) / f"r{group.rank}", None, group)
        data = batches(trainer, args.warmup + args.steps, args.groups, args.n, args.response, 0,
                       args.min_response)
        times, cpu, tokens, parts, cells, real = [], [], 0, {}, 0, 0
        for i, b in enumerate(data):
            group.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            m = trainer.train_step(b)
            if trainer.policy.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
                tokens += sum(g.prompt_ids.shape[0] * len(g.samples)
                              + sum(s.response_ids.shape[0] for s in g.samples) for g in b)
                for k, v in m.items():
                    if k.startswith("timing_s/") and k not in ("timing_s/gen", "timing_s/weight_sync"):
                        parts[k.removeprefix("timing_s/")] = parts.get(k.removeprefix("timing_s/"), 0) + v
                lengths = [g.prompt_ids.shape[0] + s.response_ids.shape[0] for g in b for s in g.samples]
                limits = micro_limits(trainer.cfg, trainer.policy.device.type == "cuda")
                for sl in micro_batches(lengths, 0, len(lengths), *limits):
                    cells += (sl.stop - sl.start) * max(lengths[sl])
                    real += sum(lengths[sl])
        # CPU seconds (every thread of every rank: compute and the collectives' copies) per
        # step: the cost that background load on the machine changes least
        total_cpu = group.sum_floats([sum(cpu) / len(cpu)])[0]
        if group.leader:
            print(json.dumps({"ranks": group.world, "threads": args.threads, "cpu_s": total_cpu,
                              "device": str(trainer.policy.device), "dtype": args.dtype,
                              "step_s": sum(times) / len(times), "tokens_per_s": tokens / sum(times),
                              "steps": [round(t, 3) for t in times], "layout": args.layout,
                              "padding_share": 1 - real / cells,
                              "parts": {k: round(v / len(times), 3) for k, v in parts.items()},
                              "grad_norm": m["actor/grad_norm"]}), flush=True)
    finally:
        group.close()


def run_config(args, ranks: int, layout: str, port: int) -> dict:
    from actors.runtime.ranks import node_ranks

    procs = []
    with tempfile.TemporaryDirectory() as run_dir:
        for r in node_ranks(ranks, 1, 0, "127.0.0.1", port):
            env = {**os.environ, **r.env(), "OMP_NUM_THREADS": str(args.threads)}
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--rank-main", "--threads", str(args.threads),
                 "--steps", str(args.steps), "--warmup", str(args.warmup), "--device",
                 args.device, "--dtype", args.dtype, "--micro", str(args.micro), "--groups",
                 str(args.groups), "--n", str(args.n), "--response", str(args.response),
                 "--model", args.model, "--run-dir", run_dir, "--layout", layout,
                 "--max-tokens", str(args.max_tokens),
                 *(["--min-response", str(args.min_response)] if args.min_response else [])],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
        outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"ranks={ranks} failed: {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--micro", type=int, default=8, help="learner.micro_batch_size")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--response", type=int, default=20, help="response tokens (±3)")
    p.add_argument("--min-response", type=int, default=None,
                   help="response tokens uniform in [this, --response] instead of ±3")
    p.add_argument("--layouts", nargs="+", default=["packed"], choices=["packed", "padded"])
    p.add_argument("--max-tokens", type=int, default=8192, help="learner.max_tokens_per_micro_batch")
    p.add_argument("--layout", default="packed", help=argparse.SUPPRESS)
    p.add_argument("--model", default="default")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    from actors.model_store import resolve_model_path
    from actors.runtime.ranks import free_port

    args.model = str(resolve_model_path(args.model))
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    for rnd in range(args.rounds):
        for ranks in args.ranks:
            for layout in args.layouts:
                r = run_config(args, ranks, layout, free_port())
                print(f"round {rnd + 1}: ranks={ranks} {layout} threads/rank={args.threads} "
                      f"{r['device']} {r['dtype']}: {r['step_s']:.2f} s/step, "
                      f"{r['tokens_per_s']:.0f} tokens/s, {r['cpu_s']:.2f} CPU-s/step (all ranks), "
                      f"padding share {r['padding_share']:.1%} (steps {r['steps']}; "
                      f"parts {r['parts']}; load {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
