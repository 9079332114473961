"""A bounded chaos soak of a whole job on the tiny random model, then an audit of what it recorded.

``python bench/soak.py [--steps 320] [--kill-every 2:5] [--attach-every 60] [--job-kill-at 150]
[--reward-pause 0.05] [--ray] [--fuzz [--curve]]``

Each reward call sleeps ``--reward-pause`` seconds (so that a step takes about a second, and a
killed worker usually holds requests). While the learner takes ``--steps`` steps: a random sampler or reward worker is killed with
SIGKILL every ``--kill-every`` seconds (uniform in A:B; the runner restarts it), a reward worker
is attached by hand (``runner.py attach reward --to RUN_DIR``) and the previous one detached
(SIGTERM) every ``--attach-every`` seconds, and once, at step ``--job-kill-at``, the runner and
every actor are killed with SIGKILL together and the job is started again with the same run
directory (crash resume). The resident memory of the long-lived actors (replay, router, learner)
and of the runner is sampled every 2 s.

``--ray``: the job runs through Ray (``--ray ADDRESS``) on Ray's own test cluster on this
machine (``ray.cluster_utils.Cluster``: a head holding the replay buffer, router and learner, and
``--ray-nodes`` worker nodes of two CPUs for the samplers and reward workers, placed SPREAD), and
a kill is a node's: every ``--kill-every`` seconds a fresh node joins (as an autoscaler adds one)
and a worker node holding a sampler or reward worker is removed with everything on it; its
processes come back on a node with room, not counted against ``max_restarts`` (the soak sets
it to 1). The whole-job kill is the runner's: Ray's keepers go with their driver.

At the end it checks and prints: the job finished (exit 0), every step's counters balance
(issued = trained + dropped + in flight), every step 1..N has exactly one batch in the final
lineage and no group is in two of them, every issued prompt id is in the recording, and no
process of the run is left; and each long-lived process's RSS growth per 100 steps (the slope of
a least-squares line over its samples after step 50 of its incarnation). Exit 1 if a check fails.

``--fuzz``: hostile frames at every socket the job binds while it trains (``tests/wire_fuzz.py``,
seeded by ``--seed``), from step 2 until 5 steps before the end; its audit adds the fuzzed
job's checks: no actor restarted, each frame sent to be rejected counted by its actor exactly,
the replayed ones refused. The counts are exact only in processes that live throughout, so
``--fuzz`` goes with ``--kill-every 0 --attach-every 0 --job-kill-at 0``. ``--curve``: the job
runs with CURVE; the fuzzer holds the job's client key, and a key the job does not know beside
it (those frames must never be decoded).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actors.runtime.recording import last_by, read_table  # noqa: E402
from tests.jobs import TINY, actor_pids, balanced, metrics, placed_on  # noqa: E402
from tests.tiny_model import build_tiny_model  # noqa: E402
from tests.wire_fuzz import Tally, WireFuzzer, audit, summary  # noqa: E402

LONG_LIVED = ("replay", "router", "learner")
# what the actors count of a fuzzer's frames (their status)
COUNTED = {"rejected_frames", "rejected_bodies", "stale_refused", "rejected", "duplicates",
           "auth_refused"}
PACED_REWARD = '''
import time

from actors.scoring.rules import repeat_letter_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({pause})  # paces the job: steps of about a second instead of milliseconds
    return repeat_letter_score(data_source, solution_str, ground_truth, extra_info)
'''


def kind_of(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").split()
    except OSError:
        return ""
    # ... actors.main RUN_DIR KIND INDEX (one title when forked by the fork server)
    return args[-2].decode() if len(args) > 3 else ""


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def slope_per_100(points: list[tuple[int, float]]) -> float | None:
    """Least-squares MB per 100 steps over (step, MB) points."""
    if len(points) < 3 or len({s for s, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(s for s, _ in points) / n
    my = sum(m for _, m in points) / n
    sxx = sum((s - mx) ** 2 for s, _ in points)
    sxy = sum((s - mx) * (m - my) for s, m in points)
    return 100 * sxy / sxx


class RayNodes:
    """Ray's test cluster on this machine (``--ray``): a head carrying ``main`` (the replay
    buffer, router and learner) and worker nodes of two CPUs; ``lose`` removes a worker node
    holding a sampler or reward worker after a fresh one has joined."""

    STORE = 80 * 2**20  # object store bytes per node (flowrl's messages never use it)

    def __init__(self, workers: int, rng: random.Random) -> None:
        import tempfile

        from ray.cluster_utils import Cluster

        self.rng = rng
        self.temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's sockets
        (self.temp / "ray").mkdir()
        os.environ["RAY_TMPDIR"] = str(self.temp)
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 3, "resources": {"main": 1}, "object_store_memory": self.STORE,
            "include_dashboard": False, "temp_dir": str(self.temp / "ray")})
        self.workers = [self.add() for _ in range(workers)]
        self.lost: list[list[str]] = []  # per loss, the processes the node held

    def add(self):
        return self.cluster.add_node(num_cpus=2, object_store_memory=self.STORE)

    def lose(self, log: str) -> None:
        placed = placed_on(log)
        holding = [n for n in self.workers if any(
            v == n.node_id[:8] and k.split("-")[0] in ("sampler", "reward")
            for k, v in placed.items())]
        if not holding:
            return
        node = self.rng.choice(holding)
        self.lost.append(sorted(k for k, v in placed.items() if v == node.node_id[:8]))
        self.workers.append(self.add())
        self.workers.remove(node)
        self.cluster.remove_node(node)

    def close(self) -> None:
        import shutil

        self.cluster.shutdown()
        shutil.rmtree(self.temp, ignore_errors=True)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.run_dir = self.out / "run"
        self.rng = random.Random(args.seed)
        self.kills = {"sampler": 0, "reward": 0}
        self.attached: list[subprocess.Popen] = []
        self.attach_rc: list[int] = []
        self.rss: dict[str, list[tuple[int, float]]] = {}  # "KIND#INCARNATION" -> (step, MB)
        self.incarnation = 0
        self.ray = RayNodes(args.ray_nodes, self.rng) if args.ray else None
        self.fuzz: Tally | None = None  # what the fuzzer sent, once it has stopped
        self.fuzz_s = 0.0  # seconds it fuzzed

    def command(self, model: Path) -> list[str]:
        a = self.args
        return [sys.executable, "runner.py", "topology.toml", f"model.path={model}",
                f"run.dir={self.run_dir}", f"run.socket_dir={self.out / 'sockets'}", *TINY,
                f"learner.total_steps={a.steps}", "learner.save_every=20", "sampler.count=2",
                "reward.count=2", "sampler.max_restarts=100000", "reward.max_restarts=100000",
                "router.request_timeout=5", "sampler.score_timeout_s=15",
                "replay.sampler_timeout_s=10", "reward.timeout_s=5",
                *([f'reward.functions=[{{path = "{self.out / "paced_reward.py"}"}}]']
                  if a.reward_pause > 0 else []), *self.ray_args(),
                *(["security.curve=true"] if a.curve else [])]

    def ray_args(self) -> list[str]:
        """Under Ray: the cluster's address, the long-lived actors on the head, the others
        spread over the workers, a lost node's restarts not counted (``max_restarts`` 1)."""
        if self.ray is None:
            return []
        return ["--ray", self.ray.cluster.address, 'replay.host="main"', 'router.host="main"',
                'learner.host="main"', 'ray.strategy="SPREAD"', "sampler.max_restarts=1",
                "reward.max_restarts=1", "run.heartbeat_timeout=600",
                f"run.base_port={self.rng.randrange(21000, 32000, 20)}"]

    def start(self, model: Path) -> subprocess.Popen:
        self.incarnation += 1
        log = (self.out / f"runner-{self.incarnation}.log").open("w")
        return subprocess.Popen(self.command(model), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def steps(self) -> int:
        return len(metrics(self.run_dir))

    def sample_rss(self, runner: subprocess.Popen) -> None:
        step = self.steps()
        for pid in actor_pids(self.run_dir):
            kind = kind_of(pid)
            if kind in LONG_LIVED and (mb := rss_mb(pid)) is not None:
                self.rss.setdefault(f"{kind}#{self.incarnation}", []).append((step, mb))
        if (mb := rss_mb(runner.pid)) is not None:
            self.rss.setdefault(f"runner#{self.incarnation}", []).append((step, mb))

    def kill_one(self) -> None:
        if self.ray is not None:  # a node, with what it holds
            self.ray.lose((self.out / f"runner-{self.incarnation}.log").read_text())
            return
        victims = [(pid, k) for pid in actor_pids(self.run_dir)
                   if (k := kind_of(pid)) in ("sampler", "reward")]
        if victims:
            pid, kind = self.rng.choice(victims)
            try:
                os.kill(pid, signal.SIGKILL)
                self.kills[kind] += 1
            except ProcessLookupError:
                pass

    def attach_swap(self) -> None:
        for p in self.attached:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                self.attach_rc.append(p.wait(timeout=60))
        self.attached = [subprocess.Popen(
            [sys.executable, "runner.py", "attach", "reward", "--to", str(self.run_dir),
             "--name", f"reward-soak-{len(self.attach_rc)}"], cwd=ROOT,
            stdout=(self.out / f"attached-{len(self.attach_rc)}.log").open("w"),
            stderr=subprocess.STDOUT)]

    def kill_job(self, runner: subprocess.Popen) -> None:
        for p in self.attached:  # detached first: it would outlive the job it served
            p.send_signal(signal.SIGTERM)
            self.attach_rc.append(p.wait(timeout=60))
        self.attached = []
        pids = [runner.pid, *actor_pids(self.run_dir)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        runner.wait()
        deadline = time.monotonic() + 30
        while actor_pids(self.run_dir) and time.monotonic() < deadline:
            time.sleep(0.2)

    def start_fuzzing(self, runner: subprocess.Popen) -> threading.Thread:
        """The fuzzer in a thread, from step 2 until 5 steps before the end (the counters then
        settle while the job trains on)."""
        from actors.runtime.security import keygen

        while self.steps() < 2 and runner.poll() is None:
            time.sleep(0.2)
        outsider = None
        if self.args.curve:
            outsider = self.out / "outsider"
            for path in (outsider.with_suffix(".key"), outsider.with_suffix(".key_secret")):
                path.unlink(missing_ok=True)
            outsider = keygen(outsider)[1]
        fuzzer = WireFuzzer(self.run_dir, self.args.seed, outsider=outsider,
                            curve_key=self.run_dir / "keys" / "client.key_secret" if self.args.curve else None)
        print(f"=== fuzzing every socket the job binds, seed {self.args.seed}", flush=True)

        def fuzz() -> None:
            started = time.monotonic()
            try:
                self.fuzz = fuzzer.run(until=lambda: self.steps() >= self.args.steps - 5
                                       or runner.poll() is not None)
            finally:
                self.fuzz_s = time.monotonic() - started
                fuzzer.close()
        thread = threading.Thread(target=fuzz, name="fuzzer", daemon=True)
        thread.start()
        return thread

    def run(self) -> int:
        a = self.args
        self.out.mkdir(parents=True, exist_ok=True)
        model = build_tiny_model(self.out / "model")
        (self.out / "paced_reward.py").write_text(PACED_REWARD.format(pause=a.reward_pause))
        started = time.monotonic()
        runner = self.start(model)
        fuzzing = self.start_fuzzing(runner) if a.fuzz else None
        job_killed_at = None
        never = float("inf")
        next_kill = time.monotonic() + self.rng.uniform(*a.kill_every) if a.kill_every else never
        next_attach = time.monotonic() + a.attach_every if a.attach_every > 0 else never
        next_rss = 0.0
        while runner.poll() is None:
            now = time.monotonic()
            if now - started > a.limit_s:
                print(f"!!! soak over its time limit ({a.limit_s:g}s): stopping", flush=True)
                runner.send_signal(signal.SIGINT)
                runner.wait(timeout=300)
                break
            step = self.steps()
            if job_killed_at is None and step >= a.job_kill_at > 0:
                print(f"=== step {step}: kill -9 of the whole job, then resume", flush=True)
                self.kill_job(runner)
                job_killed_at = step
                runner = self.start(model)
                next_attach = time.monotonic() + a.attach_every if a.attach_every > 0 else never
                continue
            if now >= next_kill:
                self.kill_one()
                next_kill = now + self.rng.uniform(*a.kill_every)  # type: ignore[misc]
            if now >= next_attach:
                self.attach_swap()
                next_attach = now + a.attach_every
            if now >= next_rss:
                self.sample_rss(runner)
                next_rss = now + 2.0
            time.sleep(0.2)
        rc = runner.wait()
        if fuzzing is not None:
            fuzzing.join()
        for p in self.attached:
            p.send_signal(signal.SIGTERM)
            self.attach_rc.append(p.wait(timeout=60))
        try:
            return self.audit(rc, job_killed_at, time.monotonic() - started)
        finally:
            if self.ray is not None:
                self.ray.close()

    def audit(self, rc: int, job_killed_at: int | None, wall_s: float) -> int:
        rows = metrics(self.run_dir)
        final = {r["step"]: r for r in rows}  # a redone step's last line
        batches = last_by(read_table(self.run_dir, "batches"), "step")
        trained = [g for s in sorted(batches) for g in batches[s]["group_ids"]]
        prompts = read_table(self.run_dir, "prompts", ["prompt_id"]).column("prompt_id").to_pylist()
        last = final[max(final)] if final else {}
        status = [json.loads(x) for x in (self.run_dir / "status.jsonl").read_text().splitlines()]
        replay = status[-1].get("replay-0", {})  # its last status, as the job stopped
        fates = last_by(read_table(self.run_dir, "fates", ["group_id", "fate"]), "group_id")
        done = {g for g, row in fates.items() if row["fate"] in ("trained", "dropped")}
        open_prompts = len(set(prompts) - done)  # no fate: held or in flight at the end
        checks = {
            "job finished (exit 0)": rc == 0,
            "every metrics line balances": all(balanced(r) for r in rows),
            "the final counters balance": replay.get("issued") == replay.get("trained", 0)
            + replay.get("dropped", 0) + replay.get("in_flight", 0),
            f"steps 1..{self.args.steps} each have one batch": sorted(batches) == list(
                range(1, self.args.steps + 1)) and sorted(final) == sorted(batches),
            "no group trained twice": len(trained) == len(set(trained)),
            "trained counter = groups in the batches": int(last.get("replay/trained", -1))
            == len(trained),
            "prompt ids 0..N-1 recorded once each": sorted(prompts) == list(range(len(prompts))),
            "no prompt lost (each trained, dropped, or open at the end)":
                open_prompts <= replay.get("in_flight", 0) and len(prompts) >= replay.get("issued", 0),
            "attached workers detached with 0": all(c == 0 for c in self.attach_rc),
            "no process of the run left": not actor_pids(self.run_dir),
        }
        growth = {key: slope_per_100([(s, m) for s, m in pts if s >= 50 + (pts[0][0] if pts else 0)])
                  for key, pts in sorted(self.rss.items())}
        report = {
            "wall_s": round(wall_s), "steps": len(final), "job_killed_at_step": job_killed_at,
            "kills": self.kills if self.ray is None else {"nodes": len(self.ray.lost),
                                                           "processes": sum(map(len, self.ray.lost))},
            "attached": len(self.attach_rc),
            "restarts": {k: v.get("restarts_by_cause", v.get("restarts"))
                         for k, v in status[-1].items() if isinstance(v, dict) and "restarts" in v},
            "router": {k: status[-1].get("router-0", {}).get(k) for k in ("resent", "duplicates")},
            "replay": {k.removeprefix("replay/"): last.get(k) for k in (
                "replay/issued", "replay/trained", "replay/dropped", "replay/in_flight",
                "replay/dropped_stale", "replay/dropped_score_failed")},
            "groups_trained": len(trained), "prompts_recorded": len(prompts),
            "prompts_open_at_end": open_prompts, "replay_final": {
                k: replay.get(k) for k in ("issued", "trained", "dropped", "in_flight",
                                           "reissued_silent", "rejected")},
            "rss_mb_first_last": {k: (round(p[0][1], 1), round(p[-1][1], 1), p[0][0], p[-1][0])
                                  for k, p in sorted(self.rss.items()) if p},
            "rss_growth_mb_per_100_steps": {k: None if v is None else round(v, 2)
                                            for k, v in growth.items()},
            "checks": checks,
        }
        if self.fuzz is not None:
            fuzz_checks = audit(self.run_dir, self.fuzz, rc)
            checks.update({f"fuzz: {k}": v for k, v in fuzz_checks.items()})
            report["fuzz"] = {"seed": self.args.seed, "minutes": round(self.fuzz_s / 60, 2),
                                "frames_per_s": round(self.fuzz.total() / max(self.fuzz_s, 1e-9)),
                                **summary(self.fuzz), "counted": {
                                    name: {k: v for k, v in row.items() if k in COUNTED}
                                    for name, row in status[-1].items()
                                    if isinstance(row, dict) and COUNTED & set(row)},
                                "runner_rejected_frames": status[-1].get("rejected_frames", 0)}
        (self.out / "soak.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))
        return 0 if all(checks.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--kill-every", default="2:5", help="seconds A:B between kills (0: none)")
    parser.add_argument("--attach-every", type=float, default=60.0, help="seconds (0: none)")
    parser.add_argument("--job-kill-at", type=int, default=150, help="0: no whole-job kill")
    parser.add_argument("--limit-s", type=float, default=3600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reward-pause", type=float, default=0.05,
                        help="seconds each reward call sleeps (0: the built-in scorer alone)")
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("--ray", action="store_true",
                        help="through Ray on its test cluster here: kills are node losses")
    parser.add_argument("--ray-nodes", type=int, default=3, help="worker nodes under --ray")
    parser.add_argument("--fuzz", action="store_true",
                        help="hostile frames at every socket the job binds (seeded by --seed)")
    parser.add_argument("--curve", action="store_true",
                        help="the job with CURVE; with --fuzz, also frames from an unknown key")
    args = parser.parse_args()
    args.kill_every = None if args.kill_every in ("0", "") else tuple(
        float(x) for x in args.kill_every.split(":"))
    if args.fuzz and (args.kill_every or args.attach_every > 0 or args.job_kill_at > 0 or args.ray):
        parser.error("--fuzz counts every rejected frame exactly, in processes that live "
                     "throughout: add --kill-every 0 --attach-every 0 --job-kill-at 0 (no --ray)")
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
