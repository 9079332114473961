"""Sandboxed child processes, driven from the event loop without blocking it.

Each ``call`` takes one idle child (or starts one, up to ``size``), sends it one ``Call`` and
awaits the reply under the per-call timeout. A child that times out is killed; one that died
(segfault, ``os._exit``, SIGXCPU, the kernel's OOM killer) is reaped; either way the next call
starts a fresh child and the failed call's items get an error outcome. Children are tracked by
pid and killed when ``Children`` closes or a call is cancelled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from actors.sandbox.protocol import (
    HEADER,
    MAX_FRAME,
    Call,
    FromChild,
    FunctionSpec,
    Outcome,
    Outcomes,
    Ready,
    Setup,
    frame,
)

_ROOT = Path(__file__).resolve().parents[2]  # so ``-m actors.sandbox.child`` imports this tree
_DECODER = msgspec.msgpack.Decoder(FromChild)


class ChildDied(Exception):
    """The child closed its pipes: it exited or was killed. The message says how."""


@dataclass(frozen=True)
class ChildrenStatistics:
    children: int
    """Children alive now (idle or busy)."""
    started: int
    """Children started since the set was made (replacements included)."""
    timeouts: int
    """Calls killed at the per-call timeout."""
    crashes: int
    """Calls whose child died under them."""


def _death(returncode: int | None, setup: Setup) -> str:
    if returncode is None:
        return "child process closed its pipe"
    if returncode >= 0:
        return f"child process exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    key = setup.limits_key
    hint = {"SIGXCPU": f" (over {key}.cpu_s = {setup.cpu_s})",
            "SIGKILL": f" (the OOM killer? {key}.memory_mb = {setup.memory_mb})"}.get(name, "")
    return f"child process killed by {name}{hint}"


class _Child:
    def __init__(self, process: Process) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self._stdin = process.stdin
        self._stdout = BufferedByteReceiveStream(process.stdout)

    async def request(self, message: msgspec.Struct) -> FromChild:
        """Send one frame and await the reply; ChildDied if the pipes break."""
        try:
            await self._stdin.send(frame(message))
            (size,) = HEADER.unpack(await self._stdout.receive_exactly(HEADER.size))
            if size > MAX_FRAME:
                raise ChildDied(f"child sent a frame of {size} bytes")
            return _DECODER.decode(await self._stdout.receive_exactly(size))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream,
                anyio.IncompleteRead) as exc:
            raise ChildDied(str(exc)) from None


class Children:
    """Up to ``size`` children, each serving one call at a time, all able to call any of
    ``functions``. Children start on first use and are replaced after a timeout or a crash."""

    def __init__(self, functions: list[FunctionSpec], *, size: int, timeout_s: float,
                 memory_mb: int, cpu_s: int, start_timeout_s: float = 60.0,
                 limits_key: str = "reward", timeout_key: str = "timeout_s") -> None:
        self.functions = functions
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        # limits_key: the config section whose limits these are (errors name its keys)
        self._setup = Setup(functions, memory_mb=memory_mb, cpu_s=cpu_s, limits_key=limits_key)
        self._timeout_key = f"{limits_key}.{timeout_key}"  # named in timeout errors
        self._slots = anyio.Semaphore(size)
        self._idle: list[_Child] = []  # alive and not serving a call
        self._alive: dict[int, _Child] = {}  # every child not yet reaped, by pid
        self._started = self._timeouts = self._crashes = 0

    def statistics(self) -> ChildrenStatistics:
        return ChildrenStatistics(len(self._alive), self._started, self._timeouts, self._crashes)

    async def call(self, call: Call) -> list[Outcome]:
        """``call.items`` outcomes from ``functions[call.function]`` (called once per argument
        set, or once for all when it is a batch function); never raises for anything the child
        does."""
        n = call.items
        async with self._slots:
            try:
                child = await self._take()
            except ChildDied as exc:
                self._crashes += 1
                return [Outcome(error=str(exc), failure="crash")] * n
            healthy = False
            try:
                with anyio.move_on_after(self.timeout_s):
                    reply = await child.request(call)
                    if not isinstance(reply, Outcomes) or len(reply.outcomes) != n:
                        return [Outcome(error="child answered out of protocol; replaced",
                                        failure="crash")] * n
                    healthy = True
                    return reply.outcomes
                self._timeouts += 1
                return [Outcome(error=f"timed out after {self.timeout_s:g} s "
                                      f"({self._timeout_key}); child killed and "
                                      "replaced", failure="timeout")] * n
            except ChildDied:
                self._crashes += 1
                returncode = await self._reap(child)
                return [Outcome(error=f"{_death(returncode, self._setup)} while "
                                      "running; replaced", failure="crash")] * n
            finally:
                if healthy:
                    self._idle.append(child)
                else:
                    with anyio.CancelScope(shield=True):
                        await self._kill(child)

    async def aclose(self) -> None:
        """Kill every child (calls in flight are the caller's to cancel first)."""
        with anyio.CancelScope(shield=True):
            for child in list(self._alive.values()):
                await self._kill(child)
        self._idle.clear()

    async def _take(self) -> _Child:
        """An idle child that is still alive (one killed from outside is reaped), or a new one."""
        while self._idle:
            child = self._idle.pop()
            if child.process.returncode is None:
                return child
            await self._kill(child)
        return await self._start()

    async def _start(self) -> _Child:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
        # own session: a Ctrl-C in the terminal is the worker's to handle, and it kills us
        process = await anyio.open_process([sys.executable, "-m", "actors.sandbox.child"],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=None, env=env, start_new_session=True)
        child = _Child(process)
        self._alive[process.pid] = child
        self._started += 1
        try:
            with anyio.fail_after(self.start_timeout_s):
                ready = await child.request(self._setup)
        except TimeoutError:
            await self._kill(child)
            raise ChildDied(f"child did not load its functions within "
                            f"{self.start_timeout_s:g} s") from None
        except ChildDied:
            returncode = await self._reap(child)
            raise ChildDied(f"child failed to start: {_death(returncode, self._setup)}") from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._kill(child)
            raise
        if not isinstance(ready, Ready):
            await self._kill(child)
            raise ChildDied("child answered its setup out of protocol")
        return child

    async def _reap(self, child: _Child) -> int | None:
        """The exit status of a child whose pipe broke (killing it if it lingers)."""
        with anyio.move_on_after(2.0):
            await child.process.wait()
        await self._kill(child)
        return child.process.returncode

    async def _kill(self, child: _Child) -> None:
        if child.process.returncode is None:
            try:
                child.process.kill()
            except ProcessLookupError:
                pass
        await child.process.aclose()  # closes the pipes and waits: no zombie
        self._alive.pop(child.process.pid, None)
