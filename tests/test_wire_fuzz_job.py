"""A whole job trains while every socket it binds is fuzzed (``tests/wire_fuzz.py``), with CURVE
on: the fuzzer holds the job's client key (an insider: its frames reach decoding) and, beside
it, a key the job does not know (an outsider: its frames must never be decoded). No actor dies,
hangs or restarts; nothing is lost or trained twice; every frame sent to be rejected is counted
by the actor it was sent to, exactly, and each kind is logged once per socket.

Seeded: ``FLOWRL_FUZZ_SEED=N`` repeats a run's frames (the seed is in every failure's message).
The long form: ``python bench/soak.py --fuzz`` (minutes).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from collections import Counter

from actors.runtime.security import keygen
from tests.jobs import actor_pids, metrics, reap, start_job, status_lines, wait_for_steps
from tests.wire_fuzz import WireFuzzer, audit, summary

KINDS = {"random", "truncated", "bitflip", "wrong type", "unknown type", "oversized", "extra frames"}


def fuzz_seed() -> int:
    """``FLOWRL_FUZZ_SEED``, or a fresh one (printed, and named in every failure)."""
    seed = int(os.environ.get("FLOWRL_FUZZ_SEED") or random.randrange(2**32))
    print(f"wire fuzz seed {seed}: FLOWRL_FUZZ_SEED={seed} repeats it", file=sys.stderr)
    return seed


def test_a_job_trains_through_hostile_frames_on_every_socket(tiny_model, tmp_path):
    seed = fuzz_seed()
    outsider = keygen(tmp_path / "mallory")[1]
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    total = 14
    proc = start_job(tiny_model, run_dir, log, f"learner.total_steps={total}", "security.curve=true")
    try:
        wait_for_steps(run_dir, 2, proc, timeout=180)
        fuzzer = WireFuzzer(run_dir, seed, curve_key=run_dir / "keys" / "client.key_secret",
                            outsider=outsider)
        try:
            # until 4 steps before the end, the old frames replayed by then
            tally = fuzzer.run(until=lambda: len(metrics(run_dir)) >= total - 4
                               and fuzzer.tally.stale > 0 or proc.poll() is not None)
        finally:
            fuzzer.close()
        proc.wait(timeout=180)
    finally:
        reap(proc)
    said = f"seed {seed}: {summary(tally)}\n{log.read_text()[-3000:]}"
    checks = audit(run_dir, tally, proc.returncode)
    assert all(checks.values()), (sorted(k for k, ok in checks.items() if not ok), said)
    assert set(tally.kinds) == KINDS and min(tally.bad.values()) > 0, said
    assert tally.bodies and tally.group_replays and tally.stale and tally.score_replays, said
    assert not actor_pids(run_dir)

    # the outsider: its handshakes refused by each actor that binds, nothing of it decoded (the
    # counts above are exactly the insider's)
    last = status_lines(run_dir)[-1]
    assert tally.outsider_connections >= 5, said
    assert all(last[a].get("auth_refused", 0) > 0 for a in ("replay-0", "router-0", "learner-0")), said
    assert last.get("auth_refused", 0) > 0, said  # the runner's control socket's, its own field

    # each kind of rejection said once per socket (the interval is a minute), naming the socket
    lines = re.findall(r"^(\[[\w-]+\] .+?): rejected a frame \(([\w -]+)\)", log.read_text(),
                       re.MULTILINE)
    assert max(Counter(lines).values()) == 1, said
    sockets = {socket.split(" ipc:")[0] for socket, _ in lines}
    assert {"[replay-0] ROUTER", "[router-0] clients ROUTER", "[router-0] workers ROUTER",
            "[learner-0] weights ROUTER", "[runner] control ROUTER",
            "[reward-0] request bodies from the router"} <= sockets, said


def test_a_seed_repeats_the_frames(tmp_path, monkeypatch):
    """The same seed damages the same frames in the same order (a failure reproduces)."""
    (tmp_path / "topology.json").write_text(json.dumps({
        "replay": {"address": "ipc://r"}, "router": {"address": "ipc://c", "worker_address": "ipc://w"},
        "learner": {"weights_address": "ipc://l"}, "control_address": "ipc://x",
        "security": {"curve": False, "server_key": ""}}))
    monkeypatch.setenv("FLOWRL_FUZZ_SEED", "1234")
    assert fuzz_seed() == 1234

    def frames(seed: int) -> list[tuple[str, list[bytes]]]:
        fuzzer = WireFuzzer(tmp_path, seed)
        try:
            return [fuzzer.damaged() for _ in range(300)]
        finally:
            fuzzer.close()
    first = frames(1234)
    assert frames(1234) == first != frames(1235)
    assert {kind for kind, _ in first} == KINDS
