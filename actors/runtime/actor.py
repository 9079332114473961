"""Lifecycle shared by every actor process: start, ready, heartbeat, stop.

An actor is an async function ``body(ctx, task_status)`` that binds or connects its sockets,
calls ``task_status.started()`` and then serves until it returns (its work is done) or is
cancelled. ``run_actor`` wraps it: it connects the control DEALER to the runner, reports
``Ready``, sends a ``Heartbeat`` with the actor's status every few seconds, and turns a
``Stop`` message, SIGTERM or SIGINT into cancellation of the actor's task group. A body that can
drain (a sampler: ``ActorContext.drain_grace_s``) is asked to on the first signal instead, and
returns once it has handed its work back (cancelled after its grace or a second signal). An exception
escapes as a traceback written to ``RUN_DIR/logs/NAME.traceback`` and exit status 1.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import anyio
import anyio.lowlevel
import msgspec
import zmq

from actors.runtime.config import ProcessName, Topology
from actors.runtime.rundir import EXIT_DISK_FULL, DiskFull, traceback_file
from actors.runtime.security import CurveKeys, HandshakeRefused, ZapHandler
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from messages.codec import Codec, DecodeError, encode
from messages.control import ErrorReply, Finished, Heartbeat, Ready, StatusValue, Stop, ToActor


@dataclass
class ActorContext:
    """What an actor body gets: who it is, the resolved topology, its run directory."""

    kind: str
    index: int
    topology: Topology
    run_dir: Path
    zmq: zmq.Context
    status: dict[str, StatusValue] = field(default_factory=dict)
    """Published in every heartbeat; the body updates it as it works."""
    control: AsyncSocket | None = None
    """DEALER to the runner (None when the actor runs without a runner, e.g. in tests)."""
    label: str = ""
    """A name other than ``KIND-INDEX`` (a worker attached by hand: ``reward-attached-PID``)."""
    curve: CurveKeys | None = None
    """CURVE keys for every socket the actor makes (None: the job runs without ``[security]``)."""
    zap: ZapHandler | None = None
    """The ZAP handler of this process's context, whose refusals the heartbeat reports."""
    drain_grace_s: float | None = None
    """Set by a body that can drain (before it reports started): the first SIGTERM or Ctrl-C
    then sets ``draining`` instead of cancelling, and the body returns once it has handed its
    work back; cancellation comes after this many seconds (plus a margin) or a second signal.
    None: a signal cancels at once."""
    draining: anyio.Event | None = None
    """Set when the body is asked to drain (made by ``serve_actor``)."""

    @property
    def name(self) -> str:
        return self.label or str(ProcessName(self.kind, self.index))

    async def report(self, message: msgspec.Struct) -> None:
        """Send a control message (StepReport, Finished, ...) to the runner, if there is one."""
        if self.control is not None:
            await self.control.send_multipart([encode(message)])


Body = Callable[..., Awaitable[Any]]


async def _orphan_watch(scope: anyio.CancelScope, parent: int) -> None:
    """Stop when the runner that started this actor is gone (no orphans if it is killed): the
    parent is the runner, or the local launcher's fork server, which ends with the runner.

    PR_SET_PDEATHSIG would fire when the *thread* that spawned us exits (trio spawns from a
    worker thread), so the parent pid is watched instead: on its death we are re-parented.
    """
    while os.getppid() == parent:  # noqa: ASYNC110 - a parent's death raises no event to wait on
        await anyio.sleep(1.0)
    scope.cancel()


async def _heartbeats(ctx: ActorContext, interval: float) -> None:
    started = time.monotonic()
    while True:
        ctx.status["uptime_s"] = round(time.monotonic() - started, 1)
        if ctx.zap is not None and ctx.zap.refused:
            ctx.status["auth_refused"] = ctx.zap.refused
        await ctx.report(Heartbeat(actor=ctx.name, status=dict(ctx.status)))
        await anyio.sleep(interval)


async def _control_listener(ctx: ActorContext, scope: anyio.CancelScope) -> None:
    codec: Codec[ToActor] = Codec(ToActor)
    assert ctx.control is not None
    while True:
        frames = await ctx.control.recv_multipart()
        try:
            msg = codec.decode(frames[-1])
        except DecodeError as exc:
            await ctx.control.send_multipart([encode(ErrorReply(error=f"bad control frame: {exc}"))])
            continue
        if isinstance(msg, Stop):
            ctx.status["state"] = "stopping"
            scope.cancel()
            return


_stop_signalled = False  # a stop signal arrived outside the receiver below
CONTROL_LINGER_MS = 1000  # the last reports (Finished) get this long to leave at exit
DRAIN_MARGIN_S = 5.0  # past a body's drain grace: time to say goodbye before cancellation


def _note_signal(signum: int, frame: object) -> None:
    # one store, no lock: signals that keep coming may nest this handler at its entry, and a
    # handler that took locks or called functions would nest deeper under a burst
    global _stop_signalled
    _stop_signalled = True


def hold_stop_signals() -> None:
    """From here until the process ends, SIGTERM and SIGINT are noted, never fatal: an actor
    stops on them (at once if one came before it started), and one that comes while the process
    exits changes nothing. Called first thing by an actor's process (``actors/main.py``,
    ``runner.py attach``), which then ends through ``exit_process``: the interpreter's own
    teardown puts the default handlers back before it frees the process's objects, so a signal
    during those seconds would kill a process that had already finished its work (status -15
    after a clean drain)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _note_signal)


def stop_signalled() -> bool:
    """Whether SIGTERM or SIGINT came since ``hold_stop_signals`` (before the actor ran: it
    stops before serving)."""
    return _stop_signalled


async def _signals(ctx: ActorContext, scope: anyio.CancelScope) -> None:
    # Ctrl-C in a terminal reaches every actor and the runner (whose Stop follows): the first
    # of the two cancels; signals still queued when the receiver closes are re-delivered by
    # trio to the process handler, ``_note_signal`` (``hold_stop_signals``): no
    # KeyboardInterrupt in the middle of shutdown. A body that drains (``drain_grace_s``) is
    # asked to first; a second signal, or the grace running out, cancels.
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        if not _stop_signalled:
            async for _ in signals:
                break
        if ctx.drain_grace_s is not None and ctx.draining is not None:
            ctx.draining.set()
            ctx.status["state"] = "draining"
            with anyio.move_on_after(ctx.drain_grace_s + DRAIN_MARGIN_S):
                async for _ in signals:
                    break
        scope.cancel()


async def serve_actor(ctx: ActorContext, body: Body, control_address: str | None,
                      parent: int | None = None, *,
                      task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Run ``body`` under the lifecycle: ready, heartbeats, stop on message or signal.

    Started with ``await tg.start(serve_actor, ...)``, it returns once the body has bound or
    connected its sockets and ``Ready`` is reported: the actor is serving from then on."""
    if control_address:
        ctx.control = make_socket(ctx.zmq, zmq.DEALER, connect=control_address,
                                  identity=ctx.name.encode(), curve=ctx.curve)
    try:
        async with anyio.create_task_group() as tg:
            ctx.draining = anyio.Event()
            tg.start_soon(_signals, ctx, tg.cancel_scope)
            if parent is not None:
                tg.start_soon(_orphan_watch, tg.cancel_scope, parent)
            if ctx.control is not None:
                tg.start_soon(_control_listener, ctx, tg.cancel_scope)
            ctx.status["state"] = "starting"

            async def body_then_finish(*, task_status: anyio.abc.TaskStatus[None]) -> None:
                detail = await body(ctx, task_status=task_status)
                ctx.status["state"] = "finished"
                await ctx.report(Finished(actor=ctx.name, detail=str(detail or ""),
                                          status=dict(ctx.status)))
                tg.cancel_scope.cancel()

            # heartbeats from the start: a long start (loading a model, starting an engine) shows
            # its progress (the body sets ``status["state"]``) and is not taken for a dead actor
            tg.start_soon(_heartbeats, ctx, ctx.topology.run.heartbeat_interval)
            await tg.start(body_then_finish)
            ctx.status["state"] = "running"
            await ctx.report(Ready(actor=ctx.name, pid=os.getpid(), status=dict(ctx.status)))
            task_status.started()
    finally:
        if ctx.control is not None:
            try:  # the status it ends with (a version loaded since the last heartbeat): the
                # runner's record of the stop shows that, not the last interval's
                ctx.control.send_multipart_nowait([encode(Heartbeat(actor=ctx.name,
                                                                    status=dict(ctx.status)))])
            except zmq.ZMQError:
                pass
            ctx.control.close(linger=CONTROL_LINGER_MS)


def exit_process(code: int) -> NoReturn:
    """End this process (an actor, or a command of ``runner.py``) with ``code`` as a normal
    exit does (its other threads joined, the atexit handlers run, buffered output flushed),
    without the interpreter's teardown after that: its last garbage collections walk every
    object torch and transformers created (a second or more per process on a small machine, at
    every stop of every actor), native libraries' threads can abort it there, and the process's
    memory is freed whole anyway. ``run_actor`` has closed what the actor opened (its sockets,
    recording, engines) before this is called.

    The first two steps are the interpreter's own, in its order: ``threading._shutdown`` runs
    the threading exit hooks (an executor left open wakes its workers there) and then joins the
    non-daemon threads; joining them without the hooks first would wait on such workers forever."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def run_actor(kind: str, index: int, topology: Topology, run_dir: Path, body: Body, *,
              name: str = "", supervised: bool = True, curve: CurveKeys | None = None,
              report_to: str = "") -> int:
    """Process entry point: run one actor on trio; returns the exit status.

    ``supervised=False`` (a worker attached by hand): no watch on the parent process, and a
    control channel only to ``report_to`` (the job's runner, which then shows it in the status
    as an attached ``kind``; empty: none); it runs until it is stopped by a signal or a Stop.
    With ``curve`` keys every socket uses CURVE, and a process holding the server key answers
    ZAP requests.
    """
    ctx = ActorContext(kind=kind, index=index, topology=topology, run_dir=run_dir,
                       zmq=zmq.Context(), label=name, curve=curve)
    if curve is not None and curve.server_secret is not None:
        ctx.zap = ZapHandler(ctx.zmq, {curve.public}, topology.security.authorized_keys,
                             log=lambda text: print(f"[{ctx.name}] {text}", file=sys.stderr, flush=True))
    control = None if topology.control_address == "auto" or not supervised else topology.control_address
    if not supervised:
        control = report_to or None
        ctx.status["attached"] = kind  # the runner adds a row for it when it reports Ready
    parent = os.getppid() if supervised else None
    hold_stop_signals()
    try:
        anyio.run(serve_actor, ctx, body, control, parent, backend="trio")
        return 0
    except KeyboardInterrupt:
        return 0
    except BaseException as exc:
        refused = _only(exc, HandshakeRefused)
        if refused is not None:  # says all there is to say: no traceback
            sys.stderr.write(f"error: [{ctx.name}] {refused}\n")
            return 1
        where = traceback_file(run_dir, ctx.name)
        where.parent.mkdir(parents=True, exist_ok=True)
        full = _only(exc, DiskFull)
        if full is not None:  # one line says it; the runner ends the job (no restart)
            sys.stderr.write(f"error: [{ctx.name}] {full}\n")
            with contextlib.suppress(OSError):  # (the disk is full: it may not fit)
                where.write_text(f"{full}\n")
            return EXIT_DISK_FULL
        text = traceback.format_exc()
        where.write_text(text)
        sys.stderr.write(f"[{ctx.name}] died:\n{text}")
        return 1
    finally:
        if ctx.zap is not None:
            ctx.zap.close()
        ctx.zmq.destroy(linger=0)


def _only(exc: BaseException, kind: type[Exception]) -> Exception | None:
    """``exc`` when it is a ``kind``, alone or as the sole leaf of nested exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, kind) else None
