"""How the local launcher starts actors: forked from its fork server on a machine without GPUs
(torch and transformers imported once), or each with its own interpreter
(``FLOWRL_FORKSERVER=0``, and wherever the runner sees a GPU). Either way an actor is the
process ``python -m actors.main RUN_DIR KIND INDEX`` and goes with a killed runner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.jobs import (
    ACTORS,
    ROOT,
    actor_pids,
    args_of,
    command,
    ppid,
    reap,
    status_lines,
    wait_for_steps,
)


def start(tiny_model: Path, run_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(command(tiny_model, run_dir, "learner.total_steps=1000",
                                    "run.status_interval=0.5"),
                            cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def running_actors(run_dir: Path, proc: subprocess.Popen) -> dict[str, int]:
    """The job's actors by name, once a step is trained and the runner's status names them."""
    wait_for_steps(run_dir, 1, proc)
    deadline = time.monotonic() + 60
    while True:
        last = status_lines(run_dir)[-1]
        pids = {name: last[name].get("pid") for name in ACTORS}
        if set(pids.values()) == set(actor_pids(run_dir)):
            return pids
        assert time.monotonic() < deadline, (pids, actor_pids(run_dir))
        time.sleep(0.1)


def kill_runner_alone(proc: subprocess.Popen, run_dir: Path, server: int) -> None:
    """Kill the runner alone: its fork server sees it go, the actors their parent."""
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while actor_pids(run_dir) or args_of(server):
        assert time.monotonic() < deadline, "the fork server or an actor outlived the runner"
        time.sleep(0.1)


def test_actors_are_forked_from_one_server_and_go_with_a_killed_runner(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(tiny_model, run_dir, {"FLOWRL_FORKSERVER": "1"})
    try:
        actors = running_actors(run_dir, proc)
        (server,) = {ppid(pid) for pid in actors.values()}  # one parent: the fork server
        assert b"actors.job.launchers.forkserver" in args_of(server)
        assert ppid(server) == proc.pid
        for name, pid in actors.items():  # each titled as its own command line would read
            kind, index = name.split("-")
            assert args_of(pid)[-5:] == [b"-m", b"actors.main", str(run_dir).encode(),
                                         kind.encode(), index.encode()]
        kill_runner_alone(proc, run_dir, server)
    finally:
        reap(proc)


def test_without_the_fork_server_each_actor_is_the_runners_own_process(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(tiny_model, run_dir, {"FLOWRL_FORKSERVER": "0"})
    try:
        actors = running_actors(run_dir, proc)
        assert {ppid(pid) for pid in actors.values()} == {proc.pid}
        sampler = Path(f"/proc/{actors['sampler-0']}/cmdline").read_bytes().split(b"\0")
        assert sampler[-5:] == [b"actors.main", str(run_dir).encode(), b"sampler", b"0", b""]
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a final checkpoint, every actor stopped
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130, out[-4000:]
        assert not actor_pids(run_dir)
        assert status_lines(run_dir)[-1]["outcome"] == "interrupted"
    finally:
        reap(proc)


def test_preload_never_asks_a_hub(tmp_path: Path) -> None:
    """The fork server imports the model's architecture from a local directory only: neither
    ``model.path = "default"`` before its conversion nor a hub-style name sends a request (a
    real HTTP server stands in for the hub and counts what reaches it)."""
    import http.server
    import threading

    requests: list[str] = []

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            requests.append(self.path)
            self.send_response(404)
            self.end_headers()

        do_GET = do_HEAD  # noqa: N815

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE",
                                                                 "TRANSFORMERS_OFFLINE")}
        env.update(HF_ENDPOINT=f"http://127.0.0.1:{server.server_address[1]}",
                   FLOWRL_CACHE=str(tmp_path))  # the default is not converted there
        code = ("from actors.job.launchers.forkserver import _import_architecture\n"
                "for name in ('default', 'someone/some-model'):\n"
                "    _import_architecture(name)\n")
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                       timeout=120)
    finally:
        server.shutdown()
    assert requests == []


def test_a_runner_beside_the_sessions_zygote_forks_its_server_from_it(tiny_model, tmp_path):
    """The test session's zygote (``conftest.fork_server_zygote``) forks the fork server of a
    runner started with the session's environment: already imported, in the runner's process
    group, its output the runner's, and it goes with a killed runner as one started afresh."""
    from actors.job.launchers.forkserver import ZYGOTE_ENV

    assert os.environ.get(ZYGOTE_ENV, "0") != "0", "no zygote: FLOWRL_FORKSERVER_ZYGOTE=0"
    run_dir = tmp_path / "run"
    proc = start(tiny_model, run_dir, {})  # the session's own environment
    try:
        actors = running_actors(run_dir, proc)
        (server,) = {ppid(pid) for pid in actors.values()}
        assert b"actors.job.launchers.forkserver" in args_of(server)
        assert b"--zygote" in args_of(ppid(server)) and ppid(server) != proc.pid
        assert os.getpgid(server) == os.getpgid(proc.pid)
        kill_runner_alone(proc, run_dir, server)
    finally:
        reap(proc)


STARTS_A_ZYGOTE = """
import subprocess, sys
zygote = subprocess.Popen([sys.executable, "-m", "actors.job.launchers.forkserver", "--zygote",
                           sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert zygote.stdout.readline().strip() == "zygote ready"
print(zygote.pid, flush=True)
sys.stdin.read()  # until killed
"""


def test_a_zygote_ends_with_the_process_that_started_it(tmp_path):
    """A test worker that crashes (or is killed) leaves no zygote holding its imports."""
    starter = subprocess.Popen([sys.executable, "-c", STARTS_A_ZYGOTE, str(tmp_path / "z")],
                               cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert starter.stdout is not None
        zygote = int(starter.stdout.readline())
        assert b"--zygote" in args_of(zygote)
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=30)
        deadline = time.monotonic() + 30
        while args_of(zygote):  # the kernel's signal comes as its starter ends: no event here
            assert time.monotonic() < deadline, "the zygote outlived the process that started it"
            time.sleep(0.05)
    finally:
        reap(starter)
