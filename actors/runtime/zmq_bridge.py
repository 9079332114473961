"""Await sends and receives on a plain ``zmq.Socket`` from trio (or any anyio backend).

pyzmq's own async module only works on asyncio, so actors wrap their sockets in
:class:`AsyncSocket`::

    ctx = zmq.Context.instance()
    with make_socket(ctx, zmq.DEALER, connect="ipc:///tmp/learner") as sock:
        await sock.send_multipart([b"hello"])
        reply = await sock.recv_multipart()

Any number of tasks may share one :class:`AsyncSocket`, for example one task
that receives forever while others send. Sending applies backpressure: when the
peer's high-water mark is reached, ``send_multipart`` waits until there is room
again. It never drops a message and never busy-loops. Every ``await`` on the
socket can be cancelled. A cancelled send has sent nothing, and a cancelled
receive has received nothing.

Like every zmq socket, an :class:`AsyncSocket` is not thread-safe. Use it from
a single event loop, and leave the underlying ``.socket`` alone while tasks are
waiting on the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

import anyio
import anyio.lowlevel
import zmq

if TYPE_CHECKING:
    from actors.runtime.security import CurveKeys

__all__ = ["AsyncSocket", "SocketStatistics", "endpoint", "make_socket", "open_socket"]

T = TypeVar("T")

# pyzmq's constants are enum.Flag members, whose operators run Python code on every use: the
# hot path uses their int values
_POLLIN, _POLLOUT, _EVENTS = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = _NOBLOCK | int(zmq.SNDMORE)

# How waiting works. zmq.FD is edge-triggered. It turns readable when the
# socket's command mailbox receives something, and any call on the socket (send,
# recv, even reading zmq.EVENTS) may drain the mailbox and clear it again, so
# the real readiness has to come from getsockopt(zmq.EVENTS). Invariants:
#  1. Every call on the socket is followed by an EVENTS read (_after_call), with
#     no await in between. After that read, any later state change signals the FD.
#  2. _last_events holds the latest such read. If a read shows a bit that was
#     clear before ("rising edge") and a task is waiting for that bit, all
#     waiters wake up. A task only waits after a read showed its bit clear, so
#     a ready bit is never missed, even if another task's call ate the FD edge.
#  3. At most one task (the FD waiter) is in wait_readable(fd), inside the
#     cancel scope _fd_scope, which keeps trio's BusyResourceError away. Other
#     waiters park on the _parked event. To wake everyone, cancel the scope and
#     set the event. Woken tasks just retry their operation.
#  4. A task leaving _retry with no FD waiter left wakes the parked tasks, so
#     that one of them takes over the FD.


@dataclass(frozen=True)
class SocketStatistics:
    """How many tasks are currently blocked on an :class:`AsyncSocket`."""

    tasks_waiting_send: int
    tasks_waiting_receive: int


class AsyncSocket:
    """Async wrapper around a ``zmq.Socket``; ``close()`` it (or use ``with``) when done."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self._closed = False
        self._last_events = 0
        self._waiting: dict[int, int] = {_POLLIN: 0, _POLLOUT: 0}  # tasks in _wait, per flag
        self._fd_scope: anyio.CancelScope | None = None  # the FD waiter's scope
        self._parked: anyio.Event | None = None  # created lazily: needs a running loop

    @property
    def socket(self) -> zmq.Socket:
        """The wrapped socket, for options such as ``getsockopt``."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, linger: int = 0) -> None:
        """Close the socket. Tasks blocked on it get ``anyio.ClosedResourceError``."""
        if self._closed:
            return
        self._closed = True
        self._wake_all()  # woken waiters see _closed and raise
        self._sock.close(linger=linger)

    def __enter__(self) -> AsyncSocket:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def statistics(self) -> SocketStatistics:
        return SocketStatistics(self._waiting[_POLLOUT], self._waiting[_POLLIN])

    async def send_multipart(self, frames: Sequence[Any], *, copy: bool = True) -> None:
        """Send one multipart message, waiting while the peer's high-water mark is full."""
        await self._retry(_POLLOUT, lambda: self._send(frames, copy))

    def send_multipart_nowait(self, frames: Sequence[Any], copy: bool = True) -> None:
        """Send one multipart message now, or raise ``zmq.Again`` and send nothing."""
        self._call(lambda: self._send(frames, copy))

    def _send(self, frames: Sequence[Any], copy: bool) -> None:
        # pyzmq's send_multipart, without its per-frame checks and enum arithmetic. Only the
        # first frame can raise zmq.Again: libzmq queues the rest of a message atomically.
        send = self._sock.send
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            send(frame, _MORE if i < last else _NOBLOCK, copy=copy)

    @overload
    async def recv_multipart(self, *, copy: Literal[True] = ...) -> list[bytes]: ...
    @overload
    async def recv_multipart(self, *, copy: Literal[False]) -> list[zmq.Frame]: ...

    async def recv_multipart(self, *, copy: bool = True) -> list[bytes] | list[zmq.Frame]:
        """Receive one multipart message. With ``copy=False`` the parts are ``zmq.Frame``s."""
        return await self._retry(_POLLIN, lambda: self._recv(copy))

    def recv_multipart_nowait(self, *, copy: bool = True) -> list[bytes] | list[zmq.Frame]:
        """Receive one multipart message now, or raise ``zmq.Again``."""
        return self._call(lambda: self._recv(copy))

    def _recv(self, copy: bool) -> list[Any]:
        # Frames rather than bytes: ``Frame.more`` is a field of the message, where
        # getsockopt(RCVMORE) costs an enum lookup in pyzmq on every frame
        recv = self._sock.recv
        frame = recv(_NOBLOCK, copy=False)
        parts = [frame.bytes if copy else frame]
        while frame.more:  # the rest of a message is there once its first frame is
            frame = recv(_NOBLOCK, copy=False)
            parts.append(frame.bytes if copy else frame)
        return parts

    def _call(self, op: Callable[[], T]) -> T:
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            return op()
        finally:
            self._after_call()

    def _after_call(self) -> None:
        # Invariant 1 and 2: re-read the level state and wake the tasks it concerns.
        if self._closed:
            return
        with suppress(zmq.ZMQError):  # a broken socket shows up on the next call
            events = cast(int, self._sock.get(_EVENTS))
            rising = events & ~self._last_events
            self._last_events = events
            if any(rising & flag and n for flag, n in self._waiting.items()):
                self._wake_all()

    def _wake_all(self) -> None:
        if self._fd_scope is not None:
            self._fd_scope.cancel()
        if self._parked is not None:
            self._parked.set()
            self._parked = None

    async def _retry(self, flag: int, op: Callable[[], T]) -> T:
        await anyio.lowlevel.checkpoint_if_cancelled()
        waited = False
        stuck = 0
        try:
            while True:
                try:
                    result = self._call(op)
                    break
                except zmq.Again:
                    pass
                if not self._last_events & flag:
                    stuck = 0
                    await self._wait(flag, None)
                    waited = True
                elif (stuck := stuck + 1) > 1:
                    # EVENTS keeps saying "ready" but the call keeps failing,
                    # e.g. ROUTER_MANDATORY with one full peer. Wait for a change,
                    # polling with backoff. The first time it's only a race with
                    # commands read by EVENTS, so we retry at once.
                    await self._wait(flag, min(0.0005 * 2**stuck, 0.05))
                    waited = True
        finally:
            if self._fd_scope is None:  # invariant 4
                if self._parked is not None:
                    self._parked.set()
                self._parked = None
        if not waited:
            # Finished without blocking. Still yield (trio's checkpoint rule) so
            # a tight send loop cannot starve other tasks.
            await anyio.lowlevel.cancel_shielded_checkpoint()
        return result

    async def _wait(self, flag: int, poll_after: float | None) -> None:
        """Block until this task might make progress: FD signal, wake-up or timeout."""
        self._waiting[flag] += 1
        try:
            with anyio.move_on_after(poll_after):
                if self._fd_scope is None:
                    with anyio.CancelScope() as scope:
                        self._fd_scope = scope
                        try:
                            await anyio.wait_readable(self._fd)
                        finally:
                            self._fd_scope = None
                else:
                    if self._parked is None:
                        self._parked = anyio.Event()
                    await self._parked.wait()
        finally:
            self._waiting[flag] -= 1


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    hwm: int = 1000,
    identity: bytes | None = None,
    curve: CurveKeys | None = None,
) -> AsyncSocket:
    """Create a socket of ``kind`` (e.g. ``zmq.DEALER``) with both HWMs set to ``hwm``,
    ``LINGER=0`` and an optional routing ``identity``, then bind or connect it. With ``curve``
    keys a binding socket is a CURVE server and a connecting one a CURVE client."""
    return AsyncSocket(open_socket(ctx, kind, bind=bind, connect=connect, hwm=hwm,
                                   identity=identity, curve=curve))


def open_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    hwm: int = 1000,
    identity: bytes | None = None,
    curve: CurveKeys | None = None,
) -> zmq.Socket:
    """:func:`make_socket` without the async wrapper, for a socket served by a blocking loop in
    its own thread (the router's)."""
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if curve is not None:
            if bind is not None and connect is not None:
                raise ValueError("a CURVE socket either binds (server) or connects (client)")
            curve.configure(sock, server=bind is not None)
        if bind is not None:
            sock.bind(bind)
        if connect is not None:
            sock.connect(connect)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def endpoint(sock: zmq.Socket) -> str:
    """Where ``sock`` was last bound or connected (named in the log line of a frame it refuses)."""
    return cast(bytes, sock.getsockopt(zmq.LAST_ENDPOINT)).decode(errors="replace")
