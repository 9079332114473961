"""CURVE on real sockets: keys on disk, an authorized client talks, a plain client and an
unauthorized key get nothing through, and the refusal is counted, logged and reported to the
client; and a whole job with ``[security]`` on, with attaches by hand from a good and a bad key."""

from __future__ import annotations

import contextlib
import re
import signal
import stat
import subprocess
import sys
import time

import anyio
import msgspec
import pytest
import zmq

from actors.runtime.config import ConfigError
from actors.runtime.security import (
    CurveKeys,
    HandshakeRefused,
    ZapHandler,
    attach_keys,
    handshake_monitor,
    keygen,
    load_public_keys,
    load_secret,
    watch_handshake,
)
from actors.runtime.zmq_bridge import make_socket
from tests.helpers import live_topology, wait_for
from tests.jobs import ROOT, actor_pids, alive, balanced, metrics, start_job, status_lines


def test_keygen_writes_a_private_secret_and_refuses_to_overwrite(tmp_path):
    public, secret = keygen(tmp_path / "keys" / "alice")
    assert (public.name, secret.name) == ("alice.key", "alice.key_secret")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, sec = load_secret(tmp_path / "keys" / "alice")  # the base name finds the secret file
    assert load_secret(secret) == (pub, sec) and len(pub) == len(sec) == 40
    assert load_public_keys(public) == {pub} == load_public_keys(tmp_path / "keys")
    with pytest.raises(ConfigError, match="exists"):
        keygen(tmp_path / "keys" / "alice")
    with pytest.raises(ConfigError, match="only a public key"):
        load_secret(public)
    with pytest.raises(ConfigError, match="no key file"):
        load_secret(tmp_path / "bob.key_secret")


def test_security_config_errors_name_the_key(tmp_path, sockets):
    with pytest.raises(ConfigError, match=r"security.authorized_keys: needs security.curve = true"):
        live_topology(sockets, f'security.authorized_keys="{tmp_path}"')
    with pytest.raises(ConfigError, match=r"security.curv: unknown key"):
        live_topology(sockets, "security.curv=true")


@pytest.fixture
def keys(tmp_path):
    """A server keypair and two client keypairs: ``alice`` (authorized) and ``mallory``."""
    server = load_secret(keygen(tmp_path / "server")[1])
    alice = load_secret(keygen(tmp_path / "alice")[1])
    mallory = load_secret(keygen(tmp_path / "mallory")[1])
    return server, alice, mallory


def client(server, who) -> CurveKeys:
    return CurveKeys(server_public=server[0], public=who[0], secret=who[1])


@pytest.mark.anyio
async def test_authorized_key_talks_plain_and_unauthorized_clients_get_nothing(keys, sockets):
    server, alice, mallory = keys
    ctx = zmq.Context()
    refusals: list[str] = []
    zap = ZapHandler(ctx, {alice[0]}, log=refusals.append)
    address = f"ipc://{sockets}/server"
    server_keys = CurveKeys(server[0], server[0], server[1], server_secret=server[1])
    try:
        with anyio.fail_after(10), make_socket(ctx, zmq.ROUTER, bind=address, curve=server_keys) as srv:
            with make_socket(ctx, zmq.DEALER, connect=address, curve=client(server, alice)) as good:
                await good.send_multipart([b"hello"])
                peer, body = await srv.recv_multipart()
                assert body == b"hello"
                await srv.send_multipart([peer, b"welcome"])
                assert await good.recv_multipart() == [b"welcome"]

            with make_socket(ctx, zmq.DEALER, connect=address) as plain:  # no CURVE at all
                await plain.send_multipart([b"let me in"])
                with anyio.move_on_after(0.5) as waited:
                    await srv.recv_multipart()
                assert waited.cancelled_caught  # the server never sees a plain client's message

            bad = make_socket(ctx, zmq.DEALER, curve=client(server, mallory))
            with bad:
                monitor = handshake_monitor(bad)
                bad.socket.connect(address)
                # not waited on: once the handshake is refused the socket has no peer to queue
                # for, and a send would wait for ever
                with contextlib.suppress(zmq.Again):
                    bad.socket.send_multipart([b"let me in"], flags=zmq.NOBLOCK)
                with pytest.raises(HandshakeRefused, match="refused this client's CURVE key"):
                    await watch_handshake(monitor, address, mallory[0])
                with anyio.move_on_after(0.3) as waited:
                    await srv.recv_multipart()
                assert waited.cancelled_caught
    finally:
        zap.close()
        ctx.destroy(linger=0)
    assert zap.refused == 1  # mallory's key; the plain client never reaches ZAP (no key to judge)
    assert len(refusals) == 1 and mallory[0].decode()[:8] in refusals[0]
    assert re.fullmatch(r"refused a CURVE client: key \S{8}\.\.\. from \S+", refusals[0])


@pytest.mark.anyio
async def test_a_key_added_to_the_authorized_directory_is_let_in_without_a_restart(keys, tmp_path,
                                                                                   sockets):
    server, alice, mallory = keys
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    ctx = zmq.Context()
    zap = ZapHandler(ctx, set(), str(authorized), log=lambda text: None)
    address = f"ipc://{sockets}/server"
    server_keys = CurveKeys(server[0], server[0], server[1], server_secret=server[1])
    try:
        with anyio.fail_after(10), make_socket(ctx, zmq.ROUTER, bind=address, curve=server_keys) as srv:
            with make_socket(ctx, zmq.DEALER, connect=address, curve=client(server, alice)) as early:
                await early.send_multipart([b"x"])
                await wait_for("alice refused", lambda: zap.refused == 1)
            with pytest.raises(zmq.Again):  # nothing of hers got through
                srv.recv_multipart_nowait()
            assert zap.refused == 1
            (authorized / "alice.key").write_bytes((tmp_path / "alice.key").read_bytes())
            with make_socket(ctx, zmq.DEALER, connect=address, curve=client(server, alice)) as later:
                await later.send_multipart([b"y"])
                assert (await srv.recv_multipart())[1] == b"y"
            assert zap.refused == 1
    finally:
        zap.close()
        ctx.destroy(linger=0)


def attach(to, log, *args: str) -> subprocess.Popen:
    """``runner.py attach reward --to TO ...`` started from the log's folder (an attach by
    address keeps its logs under ./attached/)."""
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, str(ROOT / "runner.py"), "attach", "reward", "--to",
                                 str(to), *args], cwd=log.parent, stdout=out,
                                stderr=subprocess.STDOUT, text=True)


def test_secured_job_runs_and_only_authorized_keys_attach(tiny_model, tmp_path):
    subprocess.run([sys.executable, "runner.py", "keygen", str(tmp_path / "alice")], cwd=ROOT,
                   check=True, capture_output=True)
    subprocess.run([sys.executable, "runner.py", "keygen", str(tmp_path / "mallory")], cwd=ROOT,
                   check=True, capture_output=True)
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    total = 60
    proc = start_job(tiny_model, run_dir, log, f"learner.total_steps={total}", "reward.capacity=1",
                     "security.curve=true", f'security.authorized_keys="{tmp_path / "alice.key"}"')
    good = bad = None
    try:
        deadline = time.monotonic() + 180  # a bound on waiting (a loaded machine starts slowly)
        while len(metrics(run_dir)) < 1:  # every actor's sockets talk: a whole step went round
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        topology = msgspec.json.decode((run_dir / "topology.json").read_bytes())
        assert len(topology["security"]["server_key"]) == 40
        secrets = [load_secret(run_dir / "keys" / f"{n}.key_secret")[1] for n in ("server", "client")]
        assert not any(s in (run_dir / "topology.json").read_bytes() for s in secrets)

        bad = attach(run_dir, tmp_path / "bad.log", "--key", str(tmp_path / "mallory.key_secret"))
        assert bad.wait(timeout=120) == 1  # refused at the handshake; a bound for a loaded start
        said = (tmp_path / "bad.log").read_text()
        assert "refused this client's CURVE key" in said and "Traceback" not in said, said
        deadline = time.monotonic() + 10
        while "[router-0] refused a CURVE client" not in log.read_text():  # the router logs it
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)

        # as from another machine: the router's address and the job's public key, no run directory
        good = attach(topology["router"]["worker_address"], tmp_path / "good.log",
                      f"--server-key={topology['security']['server_key']}",  # Z85 may begin with -
                      "--key", str(tmp_path / "alice.key_secret"), "reward.capacity=1")
        name = f"reward-attached-{good.pid}"

        def attached_done() -> int:  # the router's figures for it, as the runner recorded them
            rows = status_lines(run_dir)
            return rows[-1].get("router-0", {}).get(f"worker/{name}", {}).get("done", 0) if rows else 0

        deadline = time.monotonic() + 60
        while attached_done() < 1:
            assert good.poll() is None, (tmp_path / "good.log").read_text()
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        good.send_signal(signal.SIGINT)
        assert good.wait(timeout=30) == 0, (tmp_path / "good.log").read_text()
        assert not alive(good.pid)
        proc.wait(timeout=150)
    finally:
        for p in (good, bad, proc):
            if p is not None:
                p.kill()
                p.wait(timeout=30)
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    statuses = status_lines(run_dir)
    assert statuses[-1]["router-0"]["auth_refused"] == 1, statuses[-1]  # mallory's, and only hers
    attached = [r["router-0"][f"worker/{name}"] for r in statuses if f"worker/{name}" in r.get("router-0", {})]
    assert attached and attached[-1]["pool"] == "reward" and attached[-1]["capacity"] == 1
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    assert all(balanced(r) for r in rows)
    assert not actor_pids(run_dir)


def test_bad_authorized_keys_stop_the_runner_before_any_actor(tiny_model, tmp_path):
    res = subprocess.run([sys.executable, "runner.py", "topology.toml", f"model.path={tiny_model}",
                          f"run.dir={tmp_path / 'run'}", "security.curve=true",
                          f"security.authorized_keys={tmp_path / 'nobody.key'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert f"security.authorized_keys: no file or directory {tmp_path / 'nobody.key'}" in res.stderr


def test_attach_without_a_key_it_can_read_says_to_pass_one(tmp_path, sockets):
    topo = live_topology(sockets, "security.curve=true", f"security.keys_dir={tmp_path}/keys",
                         f"security.server_key={'x' * 40}")
    with pytest.raises(ConfigError, match="pass --key"):
        attach_keys(topo, None)
    keygen(tmp_path / "alice")
    keys = attach_keys(topo, tmp_path / "alice.key_secret")
    assert keys is not None and keys.server_secret is None and keys.server_public == b"x" * 40
