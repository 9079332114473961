"""The local launcher's fork server: one process that imports torch, transformers and the job's
actor bodies once, then forks each actor process from that state.

Every actor process started afresh pays the same imports (torch, transformers, the learner's
and sampler's modules: ~4 s of CPU each on a small machine, most of a small job's start). Forked
from a process that already holds them, an actor starts with them imported: the job's start
costs one set of imports instead of one per process. Used by the local launcher where the
runner sees no GPU (``LocalLauncher``): a process that forked after CUDA's driver was touched
cannot use CUDA, and nothing here proves every import leaves it untouched, so a machine with
GPUs starts each actor with its own interpreter.

A forked actor is the same process ``python -m actors.main ...`` would be: its environment,
working directory and output (its log file, or the runner's) are the request's, its command
line reads the same (``setproctitle``), its parent is this server, which the runner's death
ends (its socket closes), so an actor's watch on its parent works unchanged. The server reaps
each actor and tells the runner its exit status; to the supervisor a ``Forked`` is a ``Child``
like any other.

Protocol, one JSON object per line on a socket pair: the runner sends ``{"args", "env", "log",
"cwd"}``; the server answers ``{"pid"}`` (or ``{"error"}``) in order, and ``{"exit", "code"}``
whenever one of its actors ends (``code`` as ``Popen.returncode``: -N for signal N).

A zygote (``python -m actors.job.launchers.forkserver --zygote SOCKET``, named to runners by
``FLOWRL_FORKSERVER_ZYGOTE=SOCKET``) does the imports once for many jobs: each runner's fork
server is forked from it instead of started afresh, then is the same server as above (its
socket, output, working directory, environment and process group the runner's). Many jobs in
a row on one machine (the test suites start hundreds) save a fork server's imports each. The
zygote serves only a runner whose environment is its own (volatile keys aside) in its own
session; any other starts its fork server afresh, as without one.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from actors.job.launchers.base import ENTRY  # the module a forked process runs
from actors.runtime.lifetime import die_with_parent


def serve(fd: int, kinds: Sequence[str], model: str, modules: Sequence[str]) -> None:
    """The server's loop: import the bodies of ``kinds``, ``modules`` and the code of ``model``'s
    architecture, then fork an actor per request until the runner's end of the socket closes."""
    from actors.registry import BY_NAME

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the runner's to act on
    for kind in kinds:
        BY_NAME[kind].load()
    for name in modules:
        importlib.import_module(name)
    if model:
        _import_architecture(model)
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()  # SIGCHLD wakes the loop through it
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                data = sock.recv(1 << 16)
                if not data:  # the runner is gone (done, or killed): its actors see us go
                    os._exit(0)
                messages, pending = _messages(pending + data)
                for message in messages:
                    sock.sendall(_line(_fork(message, sock, sel, (wake_r, wake_w))))
            else:
                os.read(wake_r, 4096)
        _reap(sock)


def _import_architecture(model: str) -> None:
    """Import the transformers module of ``model``'s causal-LM class (each process that loads
    the model would import it otherwise). Best effort: a model this cannot read is the actors'
    to report, each as it loads it. Only a local directory is read: a name is never looked up
    on a hub (``model.path = "default"`` is its converted directory: ``model_store.model_dir``)."""
    from actors.model_store import model_dir

    local = model_dir(model)
    if not (local / "config.json").is_file():
        return
    try:
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(local, local_files_only=True))]
    except Exception:  # noqa: BLE001, S110 - left to the actors, which say what is wrong
        pass


def _line(message: dict[str, Any]) -> bytes:
    """One message as the protocol sends it: a JSON line."""
    return json.dumps(message).encode() + b"\n"


def _messages(pending: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """The whole lines of ``pending`` as messages, and the part of a line that follows them."""
    *lines, rest = pending.split(b"\n")
    return [json.loads(line) for line in lines], rest


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.sendall(_line({"exit": pid, "code": os.waitstatus_to_exitcode(status)}))


def _fork(request: dict[str, Any], sock: socket.socket, sel: selectors.BaseSelector,
          wake: tuple[int, int]) -> dict[str, Any]:
    try:
        pid = os.fork()
    except OSError as exc:
        return {"error": f"fork: {exc}"}
    if pid:
        return {"pid": pid}
    code = 1
    try:  # the child: from here on, the actor's own process
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sel.close()
        sock.close()
        for fd in wake:
            os.close(fd)
        args = request["args"]
        try:  # (before the environment changes: it takes over the memory of argv and environ)
            from setproctitle import setproctitle
        except ImportError:
            pass
        else:  # ``ps`` and /proc/PID/cmdline name the actor as its command line would
            setproctitle(subprocess.list2cmdline([sys.executable, "-m", ENTRY, *args]))
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if request["log"]:
            out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
        sys.argv = [ENTRY, *args]
        import runpy

        runpy.run_module(ENTRY, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as an exec'd interpreter would
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a closed stream has nothing to flush
                pass
        os._exit(code)


class Forked:
    """One actor forked by the server, as the supervisor's ``Child``."""

    def __init__(self, pid: int) -> None:
        import trio

        self.pid = pid
        self.returncode: int | None = None
        self._ended = trio.Event()

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode

    def _signal(self, signum: int) -> None:
        if self.returncode is None:  # (reaped: its pid may be another process's now)
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


MODULE = "actors.job.launchers.forkserver"  # this module's name, also where it runs as __main__
ZYGOTE_ENV = "FLOWRL_FORKSERVER_ZYGOTE"  # a zygote's socket: runners ask it for their server
# keys that may differ between the zygote's environment and a runner's it serves: none is
# read by an import (the server takes the runner's environment before it imports more)
VOLATILE = frozenset({"PYTEST_CURRENT_TEST", ZYGOTE_ENV, "_", "SHLVL", "PWD", "OLDPWD",
                      "COLUMNS", "LINES", "TORCHINDUCTOR_CACHE_DIR"})


def zygote(path: str) -> None:
    """Import what every job's fork server imports (every actor kind's body, the CPU's
    engine's modules, the llama architecture), then fork a fork server for each runner that
    asks on the unix socket ``path`` (``FromZygote``), until killed or until the process that
    started it ends (a test session whose worker crashed leaves no zygote behind)."""
    from actors.registry import BY_NAME, NAMES
    from actors.runtime.config import ENGINES, FALLBACK

    if not die_with_parent(os.getppid()):  # it ended before the call
        return
    own = {k: v for k, v in os.environ.items() if k not in VOLATILE}  # (imports may add keys)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for kind in NAMES:
        BY_NAME[kind].load()
    for name in (*ENGINES[FALLBACK].preload, "transformers.models.llama.modeling_llama"):
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, lambda *_: _reap_all())
    print("zygote ready", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            try:
                request = json.loads(data)
                env = request["env"]
                differs = sorted(k for k in own.keys() ^ env.keys() | {
                    k for k in own.keys() & env.keys() if own[k] != env[k]} if k not in VOLATILE)
                if differs:
                    reply: dict[str, Any] = {"error": f"environment differs in {differs[:3]}"}
                elif len(fds) != 3 or (other := _context(request["pid"])) != _context(0):
                    reply = {"error": f"another process context ({other})"}
                else:
                    reply = {"pid": _zygote_fork(request, fds, listener, conn)}
            except Exception as exc:  # noqa: BLE001 - the runner starts its server itself
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            for fd in fds:
                os.close(fd)
            conn.send(json.dumps(reply).encode())


def _context(pid: int) -> tuple:
    """What a process that forks a fork server hands on that its environment does not say:
    its session, namespaces (a runner under ``ip netns exec`` binds there), cgroups, resource
    limits, CPUs, user and groups, and niceness. ``pid`` 0: this process."""
    proc = f"/proc/{pid or os.getpid()}"
    spaces = tuple(os.readlink(f"{proc}/ns/{ns}") for ns in sorted(os.listdir(f"{proc}/ns")))
    status = [line for line in Path(f"{proc}/status").read_text().splitlines()
              if line.startswith(("Uid:", "Gid:", "Groups:"))]
    return (os.getsid(pid), spaces, Path(f"{proc}/cgroup").read_text(),
            Path(f"{proc}/limits").read_text(), sorted(os.sched_getaffinity(pid)), status,
            os.getpriority(os.PRIO_PROCESS, pid))


def _reap_all() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def _zygote_fork(request: dict[str, Any], fds: list[int], *sockets: socket.socket) -> int:
    """Fork a fork server for the runner that sent ``request``: ``fds`` are its end of the
    runner's socket pair, then the runner's stdout and stderr."""
    pgid = os.getpgid(request["pid"])
    pid = os.fork()
    if pid:
        return pid
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sock in sockets:
            sock.close()
        os.setpgid(0, pgid)  # as the runner's own child would be: a Ctrl-C reaches it alike
        os.dup2(fds[1], 1)
        os.dup2(fds[2], 2)
        os.close(fds[1])
        os.close(fds[2])
        try:
            from setproctitle import setproctitle
        except ImportError:
            pass
        else:
            setproctitle(subprocess.list2cmdline(
                [sys.executable, "-m", MODULE, str(fds[0]), ",".join(request["kinds"]),
                 request["model"], *request["modules"]]))
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        serve(fds[0], request["kinds"], request["model"], request["modules"])
    except BaseException:  # noqa: BLE001 - as a server started afresh would say it
        traceback.print_exc()
    finally:
        os._exit(1)


class ZygoteForked:
    """A fork server forked by the zygote, as ``ForkServer.process`` (the zygote reaps it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid)

    def kill(self) -> None:
        try:
            signal.pidfd_send_signal(self._fd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._fd, selectors.EVENT_READ)
        sel.select()  # readable once the process has exited
        sel.close()
        os.close(self._fd)


def from_zygote(path: str, kinds: Sequence[str], model: str,
                modules: Sequence[str], env: dict[str, str], cwd: Path,
                theirs: socket.socket) -> ZygoteForked | None:
    """A fork server forked by the zygote at ``path`` for this runner, or None where it
    cannot serve this runner (gone, or another environment or session)."""
    request = {"pid": os.getpid(), "kinds": list(kinds), "model": model,
               "modules": list(modules), "env": env, "cwd": str(cwd)}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(30)
            conn.connect(path)
            socket.send_fds(conn, [json.dumps(request).encode()],
                            [theirs.fileno(), sys.stdout.fileno(), sys.stderr.fileno()])
            reply = json.loads(conn.recv(1 << 16))
    except (OSError, ValueError):
        return None
    return ZygoteForked(reply["pid"]) if "pid" in reply else None


class ForkServer:
    """The runner's side: starts the server, asks it for actors, follows their exits."""

    def __init__(self, kinds: Sequence[str], model: str, modules: Sequence[str],
                 env: dict[str, str], cwd: Path) -> None:
        ours, theirs = socket.socketpair()
        argv = [str(theirs.fileno()), ",".join(kinds), model, *modules]
        full = {**os.environ, **env}
        zygote_path = os.environ.get(ZYGOTE_ENV)
        self.process: subprocess.Popen | ZygoteForked | None = None
        if zygote_path:
            self.process = from_zygote(zygote_path, kinds, model, modules, full, cwd, theirs)
        if self.process is None:
            self.process = subprocess.Popen([sys.executable, "-m", __name__, *argv], cwd=cwd,
                                            env=full, pass_fds=(theirs.fileno(),))
        theirs.close()
        self._sock = ours
        self._children: dict[int, Forked] = {}
        self._trio: Any = None  # the socket, lock and reply channel, made by the first spawn
        self.dead = False  # the server exited: the launcher starts processes itself

    async def spawn(self, args: Sequence[str], env: dict[str, str], log: Path | None,
                    cwd: Path) -> Forked:
        import trio

        if self._trio is None:
            self._sock.setblocking(False)
            put, replies = trio.open_memory_channel[dict[str, Any]](float("inf"))
            self._trio = (trio.socket.from_stdlib_socket(self._sock), trio.Lock(), replies)
            trio.lowlevel.spawn_system_task(self._read, self._trio[0], put)
        sock, one_at_a_time, replies = self._trio
        if self.dead:
            raise OSError("the fork server exited")
        request = {"args": list(args), "env": env, "log": str(log) if log else None,
                   "cwd": str(cwd)}
        async with one_at_a_time:  # the server answers requests in order
            await sock.send(_line(request))
            reply = await replies.receive()
        if "error" in reply:
            raise OSError(f"the fork server could not start {' '.join(args)}: {reply['error']}")
        return self._children[reply["pid"]]

    async def _read(self, sock: Any, put: Any) -> None:
        pending = b""
        while True:
            try:
                data = await sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:  # the server died: its actors are orphans that end themselves
                self.dead = True
                for orphan in self._children.values():
                    orphan.kill()
                    orphan.ended(-signal.SIGKILL)
                put.send_nowait({"error": "the fork server exited"})
                return
            messages, pending = _messages(pending + data)
            for message in messages:
                if "exit" in message:
                    if message["exit"] in self._children:  # (popped: a pid is reused in time)
                        self._children.pop(message["exit"]).ended(message["code"])
                    continue
                if "pid" in message:  # registered here: its exit may be the next line
                    self._children[message["pid"]] = Forked(message["pid"])
                put.send_nowait(message)

    def close(self) -> None:
        """End the server (at the job's end: its actors have exited; any left see their parent
        go and end themselves)."""
        self._sock.close()
        assert self.process is not None
        self.process.kill()
        self.process.wait()


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        zygote(sys.argv[2])
    else:
        serve(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], sys.argv[4:])
