"""ZeroMQ CURVE for a job's sockets (``[security] curve = true``).

Every socket that binds is a CURVE server holding the job's server secret key; every socket
that connects is a CURVE client that knows the server's public key and proves its own keypair.
Each process that binds runs a ZAP handler (:class:`ZapHandler`) on its ``zmq.Context``: a
client whose public key is the job's own or one of ``security.authorized_keys`` passes, any
other is refused, counted and logged with its key's prefix and address.

Keys are ZeroMQ certificate files as pyzmq's ``zmq.auth`` writes them: ``NAME.key`` holds the
public key, ``NAME.key_secret`` the public and the secret key (mode 0600). The runner keeps the
job's ``server`` and ``client`` pairs in ``security.keys_dir``; only the server's public key goes
into ``topology.json``. A CURVE handshake that fails is silent for the connecting side (it just
retries), so :func:`watch_handshake` turns the failure event of a socket's monitor into an error.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from actors.runtime.config import ConfigError, Topology
from actors.runtime.zmq_bridge import AsyncSocket

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler


@dataclass(frozen=True)
class CurveKeys:
    """The keys one process uses: a client keypair for connecting sockets, and the server's
    keys (the secret one only in processes that bind)."""

    server_public: bytes
    public: bytes
    secret: bytes
    server_secret: bytes | None = None

    def configure(self, sock: zmq.Socket, *, server: bool) -> None:
        """Make ``sock`` a CURVE server (before it binds) or client (before it connects)."""
        if server:
            if self.server_secret is None:
                raise ValueError("this process holds no CURVE server key, so it cannot bind")
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
            sock.setsockopt(zmq.ZAP_DOMAIN, b"flowrl")
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never allow
        else:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


def keygen(base: str | Path) -> tuple[Path, Path]:
    """Write a new keypair to ``BASE.key`` (public) and ``BASE.key_secret`` (mode 0600)."""
    base = Path(base)
    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE support (zmq.has('curve') is False)")
    public, secret = Path(f"{base}.key"), Path(f"{base}.key_secret")
    for path in (public, secret):
        if path.exists():
            raise ConfigError(f"{path} exists; not overwriting a key")
    base.parent.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        zmq.auth.create_certificates(base.parent, base.name)
    finally:
        os.umask(old)
    public.chmod(0o644)
    return public, secret


def load_secret(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file (or the base name it was made with)."""
    path = Path(path)
    if not path.is_file() and Path(f"{path}.key_secret").is_file():
        path = Path(f"{path}.key_secret")
    if not path.is_file():
        raise ConfigError(f"no key file {path} (make one with: python runner.py keygen NAME)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{path}: not a ZeroMQ certificate: {exc}") from None
    if secret is None:
        raise ConfigError(f"{path} holds only a public key; pass the .key_secret file")
    return public, secret


def load_public_keys(path: str | Path) -> set[bytes]:
    """The public keys in a certificate file, or in every ``*.key`` file of a directory."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.key"))
    elif path.is_file():
        files = [path]
    else:
        raise ConfigError(f"security.authorized_keys: no file or directory {path}")
    keys = set()
    for file in files:
        try:
            keys.add(zmq.auth.load_certificate(file)[0])
        except (ValueError, OSError) as exc:
            raise ConfigError(f"security.authorized_keys: {file}: not a public key: {exc}") from None
    return keys


def prepare_job_keys(topology: Topology, run_dir: Path) -> Topology:
    """Runner side: make (or, on resume, reuse) the job's keypairs, check the authorized keys,
    and return the topology with the key directory and the server's public key filled in."""
    import msgspec

    sec = topology.security
    if not sec.curve:
        return topology
    if sec.authorized_keys:
        load_public_keys(sec.authorized_keys)  # a bad file is an error now, not at the first attach
    keys_dir = Path(sec.keys_dir or run_dir / "keys")
    keys_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in ("server", "client"):
        if not (keys_dir / f"{name}.key_secret").is_file():
            keygen(keys_dir / name)
    server_public, _ = load_secret(keys_dir / "server.key_secret")
    return msgspec.structs.replace(topology, security=msgspec.structs.replace(
        sec, keys_dir=str(keys_dir), server_key=server_public.decode()))


def job_keys(topology: Topology) -> CurveKeys | None:
    """The keys of one of the job's own actors (None when the job runs without CURVE)."""
    sec = topology.security
    if not sec.curve:
        return None
    server_public, server_secret = load_secret(Path(sec.keys_dir) / "server.key_secret")
    public, secret = load_secret(Path(sec.keys_dir) / "client.key_secret")
    return CurveKeys(server_public, public, secret, server_secret)


def attach_keys(topology: Topology, key: str | Path | None) -> CurveKeys | None:
    """The keys of a worker attached by hand: its own keypair (default: the job's client key,
    readable only by the job's owner) and the server's public key from the topology."""
    sec = topology.security
    if not sec.curve:
        return None
    if not sec.server_key:
        raise ConfigError("security.server_key is empty: attach to the topology.json the runner wrote")
    if key is None:
        key = Path(sec.keys_dir) / "client.key_secret"
        if not key.is_file():
            raise ConfigError(f"the job uses CURVE and there is no {key} here: pass --key "
                              "NAME.key_secret of a key listed in the job's security.authorized_keys")
    public, secret = load_secret(key)
    return CurveKeys(sec.server_key.encode(), public, secret)


class ZapHandler:
    """Answers the ZAP requests of one ``zmq.Context`` on a thread of its own.

    It binds at construction, so it must be made before any CURVE server socket of the context
    binds. A client passes when its public key is in ``allowed`` or in ``authorized_keys`` (a file
    or directory, re-read at each handshake so a key added while the job runs is honoured).
    Refusals are counted in ``refused`` and reported through ``log``.
    """

    def __init__(self, ctx: zmq.Context, allowed: set[bytes], authorized_keys: str = "",  # Z85 keys
                 log: Callable[[str], None] | None = None) -> None:
        self.refused = 0  # handshakes refused since start; written by the handler thread only
        self._allowed = frozenset(allowed)
        self._authorized = authorized_keys
        self._log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)  # the socket is the thread's from here on
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (within its 0.1 s poll) and close its socket."""
        self._stop.set()
        self._thread.join()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(100):
                    self._sock.send_multipart(self._answer(self._sock.recv_multipart()))
        finally:
            self._sock.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        version, request_id, _domain, address, _identity, mechanism, *credentials = request
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and credentials else b""  # Z85
        if key and self._is_allowed(key):
            return [version, request_id, b"200", b"OK", b"", b""]
        self.refused += 1
        shown = key.decode()[:8] + "..." if key else f"no key ({mechanism.decode()})"
        self._log(f"refused a CURVE client: key {shown} from {address.decode() or 'a local peer'}")
        return [version, request_id, b"400", b"client key not authorized", b"", b""]

    def _is_allowed(self, key: bytes) -> bool:
        if key in self._allowed:
            return True
        if not self._authorized:
            return False
        try:
            return key in load_public_keys(self._authorized)
        except ConfigError as exc:  # a broken key file refuses, it does not stop the handler
            self._log(str(exc))
            return False


class HandshakeRefused(Exception):
    """The server refused this process's CURVE handshake (its key is not authorized)."""


FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused this client's CURVE key (public key {key}...): "
                                     "add its .key file to the job's security.authorized_keys",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "did not complete a CURVE handshake (is the job running "
                                         "with [security] curve = true, with this server key?)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "broke off the CURVE handshake (wrong server key?)",
}


def handshake_monitor(sock: AsyncSocket) -> AsyncSocket:
    """A monitor of ``sock``'s handshake failures; make it before ``sock`` connects (libzmq
    reports a refused key once and does not retry)."""
    events = 0
    for event in FAILURES:
        events |= event
    return AsyncSocket(sock.socket.get_monitor_socket(events))


async def handshake_refused(monitor: AsyncSocket, address: str, public: bytes) -> None:
    """Raise :class:`HandshakeRefused` once the monitored socket's handshake with ``address``
    fails (``monitor`` stays open: cancelled, it can be watched again)."""
    while True:
        event = int(parse_monitor_message(await monitor.recv_multipart())["event"])
        if event in FAILURES:
            raise HandshakeRefused(f"{address} " + FAILURES[event].format(key=public.decode()[:8]))


async def watch_handshake(monitor: AsyncSocket, address: str, public: bytes) -> None:
    """:func:`handshake_refused`, closing ``monitor`` when it returns."""
    with monitor:
        await handshake_refused(monitor, address, public)
