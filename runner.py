"""Run an RL post-training job: ``python runner.py topology.toml [dotted.key=value ...]``.

Attach one more worker (a reward worker, a sampler) to a running job:
``python runner.py attach KIND --to RUN_DIR|ADDRESS [--name NAME] [--key KEY] [KIND.key=value ...]``
(``actors/job/attach.py``). It runs in the foreground, unsupervised by the job's runner (it
shows in the status when it can report there), until Ctrl-C or SIGTERM: then it detaches (a
reward worker says bye to the router and answers what it has in flight; a sampler finishes or
hands back its prompts within ``sampler.drain_grace_s``) and exits 0. A job with ``[security]
curve = true`` lets it in only with an authorized key (``--key NAME.key_secret``, made by
``python runner.py keygen NAME``); a refused key ends it with an error and status 1.

Debug a recorded run offline (``actors/offline``): ``python runner.py rerun RUN_DIR --step N``
trains step N again and compares its metrics with the recorded ones; ``python runner.py rerun
RUN_DIR --rescore FILE.py[:NAME]`` re-scores the recorded completions; ``python runner.py
inspect RUN_DIR`` summarises the run and plots it; ``python runner.py validate RUN_DIR
[--checkpoint step_N] [validation.*=...]`` validates a saved checkpoint (no learner).

On a Ray cluster (and KubeRay): ``python runner.py topology.toml --ray [ADDRESS]`` makes the
runner a Ray driver that places and starts every actor process through Ray (``docs/ray.md``).

Check a topology without starting anything: ``python runner.py check topology.toml
[dotted.key=value ...]`` runs every check a start runs (keys, model, data files, user code).

This file is the command line only: the job itself is started and supervised by
``actors/job/launch.py`` (resolution) and ``actors/job/supervisor.py`` (processes, watching). Exit status: 0 when the
learner finished, 130 on Ctrl-C, 1 on failure, 2 on a bad topology.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from actors.job.config.load import load_topology
from actors.registry import ATTACHABLE
from actors.runtime.config import ConfigError
from actors.runtime.security import keygen

NO_ADDRESS = "\0"  # --ray given without an address: the topology's ray.address stands


def attach_main(argv: list[str]) -> NoReturn:
    # a SIGTERM or Ctrl-C from now on is a detach: the worker stops (before it attached, at
    # once), and the process ends through exit_process, with no moment when a signal kills it
    from actors.runtime.actor import exit_process, hold_stop_signals

    hold_stop_signals()
    parser = argparse.ArgumentParser(
        prog="runner.py attach", description="Attach one worker to a running job (Ctrl-C detaches it).",
        epilog="example: python runner.py attach reward --to runs/20260101-120000 reward.capacity=8",
    )
    parser.add_argument("kind", choices=sorted(ATTACHABLE), help="kind of worker")
    parser.add_argument("--to", required=True, metavar="RUN_DIR|ADDRESS",
                        help="the job's run directory (or its topology.json), or an address "
                             "(tcp://HOST:PORT, ipc://PATH): for a reward worker the router's "
                             "worker address (the default reward config plus the reward.* "
                             "overrides given), for a sampler the job runner's control_address "
                             "(it sends the job's topology)")
    parser.add_argument("--server-key", default="", metavar="Z85",
                        help="with --to ADDRESS of a job with CURVE on: the job's server public "
                             "key (security.server_key in its topology.json), written --server-key=Z85 "
                             "(a key may begin with '-'); use with --key")
    parser.add_argument("--name", default="", help="worker name (unique; default KIND-attached-PID)")
    parser.add_argument("--pool", default="", metavar="NAME",
                        help="reward: serve the pool NAME of a [[reward.models]] entry (a "
                             "replica of its reward model or judge) instead of the rule workers' pool")
    parser.add_argument("--key", default=None, metavar="KEY",
                        help="CURVE key (NAME.key_secret from runner.py keygen) for a job with "
                             "[security]; default: the job's own client key in its keys_dir")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the worker's section")
    args = parser.parse_intermixed_args(argv)
    from actors.job.attach import attach_command

    exit_process(attach_command(args))


def offline(tool: Callable[[], int]) -> int:
    """Run an offline tool: what it cannot use (a missing run, step or file, a damaged
    recording) is one line and exit status 2."""
    from actors.offline.recorded import OfflineError
    from actors.runtime.recording import RecordingDamaged

    try:
        return tool()
    except (OfflineError, RecordingDamaged) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def rerun_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py rerun",
        description="Rerun a recorded learner step offline and compare its metrics with the "
                    "recorded ones (--step), or re-score the recorded completions with another "
                    "reward function (--rescore). Exit status: 0 match, 1 mismatch (or, with "
                    "--rescore, every sample failed to score), 2 bad input.",
        epilog="examples: python runner.py rerun RUN_DIR --step 12 --dump 40:3; "
               "python runner.py rerun RUN_DIR --rescore my_reward.py:compute_score --steps 1:10; "
               "python runner.py rerun step12.tar (a file of runner.py bundle)",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="the run directory, or a file of runner.py bundle (its step)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--step", type=int, help="the learner step to rerun")
    what.add_argument("--rescore", metavar="FILE.py[:NAME]",
                      help="a verl-style compute_score function (NAME defaults to compute_score)")
    parser.add_argument("--dump", action="append", default=[], metavar="GROUP_ID[:SAMPLE]",
                        help="--step: print the per-token tensors of these samples (repeatable)")
    parser.add_argument("--dump-dir", metavar="DIR",
                        help="--step: write the dumped samples as .pt and .parquet into DIR")
    parser.add_argument("--steps", metavar="A:B", help="--rescore: only the batches of steps A..B")
    parser.add_argument("--limit", type=int, default=0,
                        help="--rescore: at most this many groups (0: all)")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="--rescore: a sample whose reward moved by more than this flips")
    parser.add_argument("--timeout", type=float, default=0.0, metavar="S",
                        help="--rescore: seconds per call before the child is killed "
                             "(default: the run's reward.timeout_s)")
    parser.add_argument("overrides", nargs="*",
                        help="--step: dotted topology overrides for a what-if (learner.lr=1e-4)")
    args = parser.parse_intermixed_args(argv)
    bundled = Path(args.run_dir).is_file()
    if bundled and args.rescore:
        parser.error("--rescore takes a run directory, not a bundle")
    if not bundled and args.step is None and args.rescore is None:
        parser.error("one of the arguments --step --rescore is required")

    def run() -> int:
        if bundled:
            from actors.offline.bundle import rerun_bundle
            return rerun_bundle(args.run_dir, args.step, overrides=args.overrides,
                                dump=args.dump, dump_dir=args.dump_dir)
        if args.step is not None:
            from actors.offline.rerun import rerun
            return rerun(args.run_dir, args.step, overrides=args.overrides, dump=args.dump,
                         dump_dir=args.dump_dir)
        from actors.offline.rescore import rescore
        return rescore(args.run_dir, args.rescore, steps=args.steps, limit=args.limit,
                       threshold=args.threshold, timeout_s=args.timeout)

    return offline(run)


def inspect_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py inspect",
        description="Summarise a recorded run: a table of the run, the best and worst samples of "
                    "a step, the staleness histogram, and PNG plots over steps.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    parser.add_argument("--step", type=int, help="step whose best/worst samples are shown "
                                                 "(default: the last)")
    parser.add_argument("--plots", metavar="DIR", help="where the PNGs go (default RUN_DIR/plots)")
    parser.add_argument("--top", type=int, default=3, help="best and worst samples shown")
    args = parser.parse_args(argv)
    from actors.offline.inspection import inspect_run

    return offline(lambda: inspect_run(args.run_dir, step=args.step, plots=args.plots,
                                       top=args.top))


def bundle_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py bundle",
        description="One file with what rerunning a recorded step needs (the checkpoint "
                    "before it, the recorded batches from there, the topology, the base model "
                    "unless it is the embedded default, and the versions it was made with): "
                    "python runner.py rerun FILE reruns it in any directory or machine. Exit "
                    "status: 0 written, 2 bad input.",
        epilog="example: python runner.py bundle RUN_DIR --step 12 -o step12.tar")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    parser.add_argument("--step", type=int, required=True, help="the recorded step")
    parser.add_argument("-o", "--out", required=True, metavar="FILE", help="the file to write")
    args = parser.parse_args(argv)
    from actors.offline.bundle import bundle

    def write() -> int:
        out = bundle(args.run_dir, args.step, args.out)
        print(f"wrote {out} ({out.stat().st_size / 2**20:,.1f} MiB): python runner.py rerun "
              f"{out}")
        return 0

    return offline(write)


def diff_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py diff",
        description="Where two recorded runs part: step by step, the batch's groups, samples "
                    "and tokens, then the step's metrics in the trainer's order; the first "
                    "difference with both values and the weights versions behind them. Exit "
                    "status: 0 they agree, 1 they differ, 2 bad input.",
        epilog="example: python runner.py diff runs/before runs/after")
    parser.add_argument("run_a", metavar="RUN_A", help="a run directory")
    parser.add_argument("run_b", metavar="RUN_B", help="another run directory")
    args = parser.parse_args(argv)
    from actors.offline.diff import diff

    return offline(lambda: diff(args.run_a, args.run_b))


def validate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py validate",
        description="Validate a saved checkpoint of a run offline (no learner, sampler or "
                    "reward worker): the run's validation prompts, generated in this process "
                    "and scored by its reward functions, with verl's metrics (mean@N, best@N, "
                    "maj@N, pass@k). Exit status: 0 done, 2 bad input.",
        epilog="examples: python runner.py validate RUN_DIR; python runner.py validate RUN_DIR "
               "--checkpoint step_20 validation.n=8 validation.temperature=1.0; "
               "python runner.py validate RUN_DIR --checkpoint base "
               "'validation.datasets=[{path=\"data/test.parquet\"}]'",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    parser.add_argument("--checkpoint", metavar="step_N",
                        help="step_N (or N, or a checkpoint directory; base: the model the run "
                             "started from); default: the newest checkpoint")
    parser.add_argument("--out", metavar="FILE", help="write the metrics and samples as JSON")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default: the run's sampler.threads)")
    parser.add_argument("overrides", nargs="*", help="validation.* overrides (validation.n=8)")
    args = parser.parse_intermixed_args(argv)
    from actors.offline.validate import validate

    return offline(lambda: validate(args.run_dir, args.checkpoint, list(args.overrides),
                                    args.out, args.threads))


def export_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py export",
        description="Write a checkpoint of a run as a model to ship: a full fine-tuning "
                    "checkpoint as its Hugging Face model, a LoRA one as its PEFT adapter, or "
                    "with --merge as the adapter merged into its base (a Hugging Face model). "
                    "Exit status: 0 done, 2 bad input.",
        epilog="example: python runner.py export RUN_DIR --step 20 --merge")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    parser.add_argument("--step", type=int, required=True, help="the checkpoint's step")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA: merge the adapter into its base model")
    parser.add_argument("--out", metavar="DIR",
                        help="where it goes (default RUN_DIR/export/step_N[-merged])")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="--merge: the merged model's dtype")
    args = parser.parse_args(argv)
    from actors.offline.export import export

    return offline(lambda: export(args.run_dir, args.step, merge=args.merge, out_dir=args.out,
                                  dtype=args.dtype))


def keygen_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py keygen", description="Make a CURVE keypair for attaching to a secured job.",
        epilog="example: python runner.py keygen keys/alice; then list keys/alice.key in the job's "
               "security.authorized_keys and attach with --key keys/alice.key_secret")
    parser.add_argument("name", help="writes NAME.key (public) and NAME.key_secret (mode 0600)")
    args = parser.parse_args(argv)
    try:
        public, secret = keygen(args.name)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0


def check_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py check",
        description="Run every check a job runs before it starts (the topology's keys, the model, "
                    "the data files, the user's reward functions, tools and environment, each "
                    "loaded in a sandboxed child) and start nothing. Exit status: 0 ready to "
                    "run, 2 bad topology (one line naming the key).",
        epilog="example: python runner.py check topology.toml "
               "'reward.functions=[{path=\"my_reward.py\"}]'")
    parser.add_argument("topology", help="topology TOML file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=2e-5")
    args = parser.parse_intermixed_args(argv)
    from actors.job.config.preflight import preflight
    from actors.job.launch import bad_topology

    try:
        topology = load_topology(args.topology, args.overrides)
        preflight(topology)
    except ConfigError as exc:
        return bad_topology(exc)
    from actors.learner.memory import planned
    from actors.runtime.config import on_gpu, visible_gpus

    setting = topology.learner.device  # (nvidia-smi is asked for auto only)
    device = "cuda" if on_gpu(setting, setting == "auto" and bool(visible_gpus())) else "cpu"
    print(f"ok: {args.topology} is ready to run (model {topology.model.path})")
    print(planned(topology, device))
    return 0


def keys_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="runner.py keys",
        description="Every key of topology.toml with its type, range, default and doc, from the "
                    "schema itself.")
    parser.add_argument("prefix", nargs="?", default="", help="only keys starting with this, "
                        "e.g. learner or sampler.engine")
    parser.add_argument("--markdown", action="store_true",
                        help="the whole reference as Markdown (docs/configuration.md)")
    args = parser.parse_args(argv)
    from actors.job.config.reference import markdown, terminal

    if args.markdown:
        print(markdown(), end="")
        return 0
    text = terminal(args.prefix)
    if not text:
        print(f"error: no key starts with {args.prefix!r}", file=sys.stderr)
        return 2
    print(text)
    return 0


# every verb of the command line: its function and what ``runner.py --help`` says of it
VERBS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "check": (check_main, "TOPOLOGY [overrides]: every check a start runs; starts nothing"),
    "keys": (keys_main, "[PREFIX]: the topology keys with type, range, default and doc"),
    "attach": (attach_main, "KIND --to RUN_DIR|ADDRESS: one more actor joins a running job"),
    "rerun": (rerun_main, "RUN_DIR --step N | --rescore FILE.py[:NAME]: a recorded step again"),
    "inspect": (inspect_main, "RUN_DIR: a recorded run's summary, samples and plots"),
    "diff": (diff_main, "RUN_A RUN_B: where two recorded runs first differ"),
    "bundle": (bundle_main, "RUN_DIR --step N -o FILE: a step's rerun in one file"),
    "validate": (validate_main, "RUN_DIR [--checkpoint step_N]: validate a checkpoint offline"),
    "export": (export_main, "RUN_DIR --step N [--merge]: a checkpoint as a model directory"),
    "keygen": (keygen_main, "NAME: a CURVE key pair for attaching to a secured job"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in VERBS:
        return VERBS[argv[0]][0](argv[1:])
    parser = argparse.ArgumentParser(
        prog="runner.py", description="Run an async RL post-training job from a topology file "
                                      "(python runner.py TOPOLOGY [overrides]), or a verb.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="verbs (python runner.py VERB --help for each):\n"
               + "".join(f"  {verb:<9} {doc}\n" for verb, (_, doc) in VERBS.items())
               + "example: python runner.py topology.toml learner.total_steps=3 sampler.count=2",
    )
    parser.add_argument("topology", help="topology TOML file")
    parser.add_argument("--host", default="", metavar="NAME",
                        help="with a [hosts] table: start only the actors placed on host NAME "
                             "(one runner per host: by hand, ssh, or srun --host $SLURMD_NODENAME)")
    parser.add_argument("--ray", nargs="?", const=NO_ADDRESS, default=None, metavar="ADDRESS",
                        help="start the actors through Ray (run.launcher=ray): on the cluster at "
                             "ADDRESS (auto: the one this machine is in, as under ray job "
                             "submit; ray://HOST:10001; HOST:6379), or without one on a Ray "
                             "started for the job here (or the topology's ray.address)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=2e-5")
    if not argv:
        parser.print_help(sys.stderr)
        print("error: name a topology file (python runner.py topology.toml) or a verb",
              file=sys.stderr)
        return 2
    args = parser.parse_intermixed_args(argv)
    host = [f"run.host={json.dumps(args.host)}"] if args.host else []
    if args.ray is not None and "=" in args.ray:  # an override after a bare --ray
        args.overrides.append(args.ray)
        args.ray = NO_ADDRESS
    if args.ray is not None:
        host.append('run.launcher="ray"')
        if args.ray != NO_ADDRESS:
            host.append(f"ray.address={json.dumps(args.ray)}")
    from actors.job.launch import bad_topology, run_job

    try:
        topology = load_topology(args.topology, [*args.overrides, *host])
    except ConfigError as exc:
        return bad_topology(exc)
    return run_job(topology)


if __name__ == "__main__":
    # without the interpreter's teardown once the command is done (its output flushed): at
    # that teardown pyarrow's and torch's native threads could end the process with SIGABRT
    # ("terminate called without an active exception") after its work and its answer
    from actors.runtime.actor import exit_process

    exit_process(main())
