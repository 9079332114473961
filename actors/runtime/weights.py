"""The one weights channel: the learner publishes versioned weights, samplers subscribe.

The learner binds a ROUTER (``learner.weights_address``), each sampler connects a DEALER and
long-polls with ``WeightsPoll(have_version)``; the learner answers as soon as it holds a newer
version (at once for a sampler that has none). A slow sampler therefore only ever receives the
newest weights, never a queue of stale ones.

What carries the tensors is a transport (``actors/runtime/transports/``): its learner-side
sender makes the messages of a version (and, for a GPU transport, moves the bytes after them),
its sampler-side receiver turns what arrived into the typed source the engine loads. The
learner's transport is ``learner.weights_transport`` (``auto`` resolved when the topology
loads); a sampler takes whatever transport each message names.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import torch
import zmq
from safetensors import SafetensorError

from actors.runtime.tensors import from_buffer
from actors.runtime.transports.base import ReceiveInto, Receiver, Sender
from actors.runtime.transports.sources import AdapterWeights, WeightsSource, WorkerTransfer
from actors.runtime.transports.table import TRANSPORTS, arrived_by
from actors.runtime.zmq_bridge import AsyncSocket, endpoint
from messages.codec import Codec, DecodeError, encode
from messages.control import ErrorReply
from messages.weights import (
    AdapterSpec,
    FromLearnerWeights,
    ToLearnerWeights,
    WeightsHeader,
    WeightsPoll,
)


class WeightsPublisher:
    """Learner side: holds the newest published weights and answers pollers that lack them."""

    def __init__(self, sock: AsyncSocket, sender: Sender, name: str = "",
                 status: dict | None = None) -> None:
        self.sock = sock  # a ROUTER the samplers connect to
        self.status = status  # the actor's, whose rejected_frames this keeps current
        if status is not None:
            status["rejected_frames"] = 0
        self.codec: Codec[ToLearnerWeights] = Codec(ToLearnerWeights, socket=name and (
            f"[{name}] weights ROUTER {endpoint(sock.socket)}"))
        # a full peer makes a send wait (not drop a bucket); a gone one fails it (EHOSTUNREACH)
        sock.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sender = sender  # of a transport of transports.table.TRANSPORTS
        self.version = -1  # the version of ``messages``; -1 until the first publish
        self.messages: list[list] = []  # per message: [header, tensor bytes...] of ``version``
        self.waiting: dict[bytes, int] = {}  # poller identity -> version it has
        self.have: dict[bytes, int] = {}  # every poller -> the newest version it said it has
        self._polled = anyio.Event()  # set and replaced at every poll
        self.sent = 0  # weight messages sent, all pollers together
        self.failed = 0  # transfers a sampler did not complete (it polls again, or is gone)
        self.unanswered = 0  # bad polls whose error reply was dropped (the peer was full or gone)
        self.transfers = 0  # GPU transports: transfers under way
        self._ended = anyio.Event()  # set and replaced at the end of every transfer
        self._tg: anyio.abc.TaskGroup | None = None  # serve's, while it runs

    async def publish(self, version: int, tensors: list[tuple[str, torch.Tensor]], *,
                      bucket_bytes: int = 0, adapter: AdapterSpec | None = None,
                      read: Callable[[], None] | None = None) -> None:
        """Make ``tensors`` the newest weights and send them to every poller waiting for them
        (zmq: in messages of at most ``bucket_bytes`` of tensor data each; 0: one message).
        ``adapter``: the tensors are LoRA adapters of that spec, not the model's weights.
        ``read`` is called once the sender has read ``tensors`` (from then on they may change)."""
        self.messages = await self.sender.prepare(version, tensors, bucket_bytes=bucket_bytes,
                                                  adapter=adapter)
        if read is not None:
            read()
        self.version = version
        await self._answer()

    def close(self) -> None:
        """Release the transport's files or groups (samplers keep what they hold)."""
        self.sender.close()

    async def _answer(self) -> None:
        # a second _answer (a poll served while this one awaits a send) may have answered a
        # peer of this snapshot already: only a peer still waiting is answered here
        for peer, have in list(self.waiting.items()):
            if self.version > have and self.waiting.get(peer) == have:
                del self.waiting[peer]
                version = self.version
                try:
                    # this version's, even if a newer one comes
                    for frames in self.sender.messages_for(peer, self.messages):
                        await self.sock.send_multipart([peer, *frames], copy=False)
                except zmq.ZMQError as exc:
                    if exc.errno != errno.EHOSTUNREACH:
                        raise
                    self.sender.forget(peer)
                    self.have.pop(peer, None)  # not waited for at the end (wait_received)
                    continue  # the sampler is gone; a restarted one polls again
                self.sent += 1
                if self.sender.moves_bytes and self._tg is not None:  # beside the training
                    self._tg.start_soon(self._transfer, version, peer)  # (a snapshot is sent)
                elif self.sender.moves_bytes:
                    await self._transfer(version, peer)

    async def _transfer(self, version: int, peer: bytes) -> None:
        self.transfers += 1
        try:
            if not await self.sender.transfer(version, peer):
                self.failed += 1  # its receiver polls again (a new group) or is gone
        finally:
            self.transfers -= 1
            self._ended.set()
            self._ended = anyio.Event()

    async def wait_transfers(self) -> None:
        """Return once no GPU transfer is under way (each started has succeeded or failed)."""
        while self.transfers:
            await self._ended.wait()

    async def serve(self) -> None:
        """Take polls until cancelled (run it beside the training loop)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg  # GPU transports' transfers run here, one per sampler answered
            try:
                await self._serve()
            finally:
                self._tg = None

    async def _serve(self) -> None:
        while True:
            peer, *frames = await self.sock.recv_multipart()
            try:
                poll = self.codec.decode(frames[-1] if frames else b"")
            except DecodeError as exc:
                if self.status is not None:
                    self.status["rejected_frames"] = self.codec.rejected
                self._say(peer, f"weights: {exc}")
                continue
            if isinstance(poll, WeightsPoll):
                self.sender.polled(peer, poll)
                self.waiting[peer] = poll.have_version
                self.have[peer] = poll.have_version
                self._polled.set()
                self._polled = anyio.Event()
                if self.version >= 0:
                    await self._answer()

    def _say(self, peer: bytes, error: str) -> None:
        """An error reply, or none when ``peer`` does not read them (its queue is full) or is
        gone: with ROUTER_MANDATORY a send to a full peer waits, and a peer that never reads
        would stop this loop and with it every sampler's weights."""
        try:
            self.sock.send_multipart_nowait([peer, encode(ErrorReply(error=error))])
        except zmq.ZMQError as exc:  # zmq.Again (full) is one
            if exc.errno not in (errno.EAGAIN, errno.EHOSTUNREACH):
                raise
            self.unanswered += 1

    async def wait_received(self, timeout_s: float, first: bool = False) -> bool:
        """Wait until every sampler that ever polled has the newest weights (a subscriber polls
        again as soon as it receives a version), at most ``timeout_s`` (a dead one never will);
        True when all have them. Run ``serve`` beside it.

        ``first``: before that, with no bound, until some sampler has them: what comes next
        needs them (the last validation), and a learner resumed with no step left to train
        publishes before any sampler has started to poll."""
        while first and not any(v >= self.version for v in self.have.values()):
            await self._polled.wait()
        with anyio.move_on_after(timeout_s):
            while any(v < self.version for v in self.have.values()):
                await self._polled.wait()
            return True
        return False


FAILED_IN_A_ROW = 3  # GPU transfers that failed one after another before the sampler gives up


class TransfersFailing(Exception):
    """Weights transfers keep failing: the sampler stops (its traceback says why)."""


class WeightsSubscriber:
    """Sampler side: receives every newer version as it is published; ``take`` hands the
    newest not yet applied to the engine (older ones it replaced are never applied).

    A version whose bytes the engine's own workers receive (a ``WorkerTransfer``: the learner
    is broadcasting it, or holds it for them) is handed off whole: no poll goes out until the
    engine has run that transfer to its end (``WorkerTransfer.done``), so it is never replaced
    by a newer one. Replaced, it would stay started on the learner's side: over nccl the next
    version's receive would take its bytes (an engine holding one version while it reports
    another), over ipc its handles would keep a copy of the model alive in the learner.

    A GPU transfer that fails is retried with the next version (a new group); ``FAILED_IN_A_ROW``
    failures in a row raise, so a layout that can never work (two ranks of one NCCL group on one
    GPU) fails the sampler instead of polling forever.

    ``transport``: the learner's, whose receiver is built at once (its first poll may say what
    it needs, as nccl's says the engine's ranks); any other a header names is built when one
    does. ``into``: what a receiver needs of the engine."""

    def __init__(self, sock: AsyncSocket, transport: str = "",
                 into: ReceiveInto | None = None) -> None:
        self.sock = sock  # a DEALER connected to the learner's weights ROUTER
        self.received = -1  # newest version received (applied or not); -1: none yet
        self._newest: tuple[int, WeightsSource] | None = None  # received, not taken
        self._arrived = anyio.Event()  # set and replaced at every arrival
        self.error = ""  # the last malformed weights message, for the actor's status
        self.stale = 0  # weights messages of a version it had already received, dropped
        self.failed = 0  # GPU transfers failed in a row (0 after one that arrived)
        self.handing_off = -1  # the version whose worker transfer the engine has not ended
        self.into = into or ReceiveInto()  # (each receiver indexes its device)
        self.receivers: dict[str, Receiver] = {}  # by transport
        if transport:
            self.receiver(transport)

    async def wait_for(self, version: int) -> None:
        """Return once weights of ``version`` or newer have been received."""
        while self.received < version:
            await self._arrived.wait()

    def take(self) -> tuple[int, WeightsSource] | None:
        """The newest received weights not taken yet, or None. Tensors in it are read-only
        views of the received frames (or of a shared-memory file: ``SharedWeights``): copy
        them into the engine, never write to them."""
        newest, self._newest = self._newest, None
        if newest is not None:
            for receiver in self.receivers.values():
                receiver.taking(newest[1])
        return newest

    def poll(self) -> WeightsPoll:
        fields: dict[str, Any] = {}
        for receiver in self.receivers.values():
            fields.update(receiver.poll_fields())
        return WeightsPoll(have_version=self.received, **fields)

    def receiver(self, name: str) -> Receiver:
        """The receiver of transport ``name`` (built at its first use)."""
        if name not in TRANSPORTS:
            raise DecodeError(f"weights: unknown transport {name!r}")
        if name not in self.receivers:
            self.receivers[name] = TRANSPORTS[name].load().receiver.build(self.into)
        return self.receivers[name]

    async def serve(self) -> None:
        """Long-poll for newer weights until cancelled."""
        codec: Codec[FromLearnerWeights] = Codec(FromLearnerWeights)
        poll = True
        while True:
            if poll:
                await self.sock.send_multipart([encode(self.poll())])
            poll = True
            try:
                header, parts = _bucket(codec, await self.sock.recv_multipart(copy=False))
                if header.bucket != 0:  # the rest of a version given up on: not an answer
                    poll = False
                    continue
                if header.version <= self.received:  # one it has, again (replayed): the learner
                    self.stale += 1  # answers a poll once, with a newer one; not an answer
                    poll = False
                    continue
                for i in range(1, header.buckets):
                    more, part = _bucket(codec, await self.sock.recv_multipart(copy=False))
                    if (more.version, more.bucket, more.buckets) != (header.version, i,
                                                                     header.buckets):
                        raise DecodeError(f"weights version {header.version}: bucket {i} of "
                                          f"{header.buckets} expected, got {more.bucket} of "
                                          f"version {more.version}")
                    parts.update(part)
                try:
                    source = await self.receiver(arrived_by(header)).receive(header, parts)
                except (RuntimeError, TimeoutError) as exc:  # a GPU transfer that failed
                    self.failed += 1
                    if self.failed >= FAILED_IN_A_ROW:
                        raise TransfersFailing(f"weights: {self.failed} transfers in a row "
                                               f"failed ({arrived_by(header)}), the last with: "
                                               f"{exc}") from exc
                    raise
                self.failed = 0
                if header.adapter is not None:
                    if not isinstance(source, Mapping):  # a vLLM worker transfer
                        raise DecodeError(f"weights version {header.version}: LoRA adapters "
                                          f"over {header.transport} reach tensors only")
                    source = AdapterWeights(header.adapter, source)
            except FileNotFoundError:  # shm: a newer version replaced it already; poll again
                continue
            except (DecodeError, ValueError, OSError, SafetensorError, RuntimeError) as exc:
                self.error = str(exc)[:200]  # RuntimeError: a GPU transfer that failed
                await anyio.sleep(1.0)  # a broken learner: do not spin on it
                continue
            ended = self._hand_off(header.version, source)
            self._newest = (header.version, source)
            self.received = header.version
            self._arrived.set()
            self._arrived = anyio.Event()
            if ended is not None:
                await ended.wait()  # the engine ran this version's transfer: ask for the next
                self.handing_off = -1

    def _hand_off(self, version: int, source: WeightsSource) -> anyio.Event | None:
        """For a worker transfer: an event set once the engine has ended it (its ``done``,
        called in this event loop, either way); None for a source held here whole."""
        if not isinstance(source, WorkerTransfer):
            return None
        ended, done = anyio.Event(), source.done

        def and_ended(exc: BaseException | None) -> None:
            try:
                done(exc)
            finally:
                ended.set()

        source.done = and_ended
        self.handing_off = version
        return ended

    def close(self) -> None:
        """Release every receiver's links or groups (an engine keeps what it mapped)."""
        for receiver in self.receivers.values():
            receiver.close()


def _bucket(codec: Codec[FromLearnerWeights], frames: list) -> tuple[WeightsHeader,
                                                                     dict[str, torch.Tensor]]:
    """One message of a version: its header and its tensors (read-only views of the frames)."""
    header = codec.decode(frames[0].buffer)
    if not isinstance(header, WeightsHeader):
        raise DecodeError("weights header does not match its frames")
    row = TRANSPORTS.get(arrived_by(header))
    framed = row is not None and row.framed  # the others carry no tensor frames
    if len(frames) != (len(header.tensors) if framed else 0) + 1:
        raise DecodeError("weights header does not match its frames")
    if not 0 <= header.bucket < header.buckets:
        raise DecodeError(f"weights bucket {header.bucket} of {header.buckets}")
    if not framed:
        return header, {}
    return header, {m.name: from_buffer(m.dtype, m.shape, f.buffer)
                    for m, f in zip(header.tensors, frames[1:], strict=True)}

