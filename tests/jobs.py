"""Shared by the tests that run whole jobs: ``runner.py`` as a user runs it, on the tiny model,
and readers of what a job records (``metrics.jsonl``, ``status.jsonl``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["sampler.engine=hf", "task.name=repeat_letter", "learner.lr=3e-3", "sampler.max_tokens=8", "run.status_interval=0",
        "run.heartbeat_interval=0.5", "validation.datasets=[]"]
FAST = ["run.status_interval=1", "run.heartbeat_interval=0.5"]
ACTORS = ("replay-0", "router-0", "learner-0", "reward-0", "sampler-0")


def command(model: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "runner.py", "topology.toml", f"model.path={model}",
            f"run.dir={run_dir}", *TINY, *overrides]


def trained_groups(model: Path, run_dir: Path, steps: int, *overrides: str,
                   env: dict[str, str] | None = None) -> list:
    """Train a tiny job of ``steps`` steps (a checkpoint each) to its end and return the groups
    it recorded, once its metrics show every step with the counters balanced."""
    from actors.runtime.recording import decode_group, read_table

    res = subprocess.run(command(model, run_dir, f"learner.total_steps={steps}",
                                 "learner.save_every=1", *overrides),
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and all(map(balanced, rows))
    return [decode_group(r["message"]) for r in read_table(run_dir, "groups").to_pylist()]


def start_job(model: Path, run_dir: Path, log: Path, *overrides: str) -> subprocess.Popen:
    with log.open("w") as out:  # a file, not a pipe: the status tables never block the runner
        return subprocess.Popen(command(model, run_dir, *FAST, *overrides), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, text=True)


def jsonl(path: Path) -> list[dict]:
    """The whole lines of a jsonl file a job is appending to (a line being written is left out)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]  # after the last newline: partial


def metrics(run_dir: Path) -> list[dict]:
    return jsonl(run_dir / "metrics.jsonl")


def validations(run_dir: Path) -> list[dict]:
    """``validation.jsonl``: one line per validation round."""
    return jsonl(run_dir / "validation.jsonl")


def status_lines(run_dir: Path) -> list[dict]:
    """The runner's record of the job (``status.jsonl``): one line per event."""
    return jsonl(run_dir / "status.jsonl")


def args_of(pid: int) -> list[bytes]:
    """The words of a process's command line ([] once it is gone): an actor forked by the local
    launcher's fork server carries its command line as one title (``setproctitle``), an exec'd
    one as separate arguments."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()
    except OSError:
        return []


def actor_pids(run_dir: Path) -> list[int]:
    """Live processes started for this run (their command line names the run directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        args = args_of(int(entry.name))
        if b"actors.main" in args and str(run_dir).encode() in args:
            pids.append(int(entry.name))
    return pids


def engine_pids(run_dir: Path) -> list[int]:
    """Live vLLM processes of this run's samplers (titled ``flowrl-vllm[NAME RUN_DIR]::...``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(b"flowrl-vllm[") and str(run_dir).encode() in cmdline \
                and alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def pids_of(run_dir: Path, kind: str) -> list[int]:
    return [pid for pid in actor_pids(run_dir) if kind.encode() in args_of(pid)]


def ppid(pid: int) -> int:
    """The parent of process ``pid``."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for_steps(run_dir: Path, steps: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(metrics(run_dir)) < steps:
        assert proc.poll() is None, f"job ended early with {proc.returncode}"
        assert time.monotonic() < deadline, f"no {steps} steps within {timeout}s"
        time.sleep(0.2)


def reap(*procs: subprocess.Popen | None) -> None:
    """Kill whichever of ``procs`` still run (a test's clean-up after a failed assertion)."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def kill_the_sampler(run_dir: Path, proc: subprocess.Popen, after_steps: int,
                     timeout: float = 240) -> str:
    """SIGKILL the job's one sampler once ``after_steps`` steps are recorded, then wait for the
    job to end; its console output. The runner must have restarted the sampler once, saying
    so in ``status.jsonl``, and finished."""
    try:
        wait_for_steps(run_dir, after_steps, proc)
        sampler = pids_of(run_dir, "sampler")
        assert len(sampler) == 1
        os.kill(sampler[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    status = status_lines(run_dir)
    (exited,) = [line for line in status if line["event"] == "exited"]
    assert exited["actor"] == "sampler-0" and exited["returncode"] == -signal.SIGKILL
    assert exited["restart"] and status[-1]["sampler-0"]["restarts"] == 1
    assert status[-1]["outcome"] == "finished"
    return out


def balanced(row: dict) -> bool:
    return row["replay/issued"] == row["replay/trained"] + row["replay/dropped"] + row["replay/in_flight"]


def placed_on(log: str) -> dict[str, str]:
    """Process -> the Ray id of its node (its first 8 characters), from the runner's
    ``=== ray: NAME on ADDRESS (node ID)`` lines: the last said of each."""
    return dict(re.findall(r"([\w.-]+) on [^ ;]+ \(node (\w+)\)", "\n".join(
        line for line in log.splitlines() if line.startswith("=== ray: "))))
