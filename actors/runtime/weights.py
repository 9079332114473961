"""The one weights channel: the learner publishes versioned weights, samplers subscribe.

Today the transport is ZeroMQ: the learner binds a ROUTER (``learner.weights_address``), each
sampler connects a DEALER and long-polls with ``WeightsPoll(have_version)``; the learner answers
as soon as it holds a newer version (at once for a sampler that has none) with one message per
bucket of tensors (``learner.weights_bucket_mb``), each a header frame and one zero-copy frame
per tensor; the sampler assembles the version and hands it to its engine whole. A slow sampler
therefore only ever receives the newest weights, never a queue of stale ones. Other transports (shared memory on one host, NCCL or
CUDA IPC on GPUs, in-flight updates) plug in behind ``WeightsPublisher.publish`` and
``WeightsSubscriber.take`` without either actor changing.
"""

from __future__ import annotations

import errno

import anyio
import torch
import zmq

from actors.runtime.tensors import from_buffer, meta, raw_bytes
from actors.runtime.zmq_bridge import AsyncSocket
from messages.codec import Codec, DecodeError, encode
from messages.control import ErrorReply
from messages.weights import (
    FromLearnerWeights,
    ToLearnerWeights,
    WeightsHeader,
    WeightsPoll,
)


class WeightsPublisher:
    """Learner side: holds the newest published weights and answers pollers that lack them."""

    def __init__(self, sock: AsyncSocket) -> None:
        self.sock = sock  # a ROUTER the samplers connect to
        # a full peer makes a send wait (not drop a bucket); a gone one fails it (EHOSTUNREACH)
        sock.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.version = -1  # the version of ``messages``; -1 until the first publish
        self.messages: list[list] = []  # per bucket: [header, tensor bytes...] of ``version``
        self.waiting: dict[bytes, int] = {}  # poller identity -> version it has
        self.sent = 0  # weight messages sent, all pollers together

    async def publish(self, version: int, tensors: list[tuple[str, torch.Tensor]], *,
                      bucket_bytes: int = 0) -> None:
        """Make ``tensors`` the newest weights and send them to every poller waiting for them,
        in messages of at most ``bucket_bytes`` of tensor data each (0: one message; a larger
        tensor travels alone)."""
        buckets = split_buckets(tensors, bucket_bytes)
        self.version = version
        self.messages = [[encode(WeightsHeader(version=version, tensors=[meta(n, t) for n, t in b],
                                               bucket=i, buckets=len(buckets))),
                          *(raw_bytes(t) for _, t in b)] for i, b in enumerate(buckets)]
        await self._answer()

    async def _answer(self) -> None:
        for peer, have in list(self.waiting.items()):
            if self.version > have:
                del self.waiting[peer]
                try:
                    for frames in self.messages:  # this version's, even if a newer one comes
                        await self.sock.send_multipart([peer, *frames], copy=False)
                except zmq.ZMQError as exc:
                    if exc.errno != errno.EHOSTUNREACH:
                        raise
                    continue  # the sampler is gone; a restarted one polls again
                self.sent += 1

    async def serve(self) -> None:
        """Take polls until cancelled (run it beside the training loop)."""
        codec: Codec[ToLearnerWeights] = Codec(ToLearnerWeights)
        while True:
            peer, *frames = await self.sock.recv_multipart()
            try:
                poll = codec.decode(frames[-1] if frames else b"")
            except DecodeError as exc:
                await self.sock.send_multipart([peer, encode(ErrorReply(error=f"weights: {exc}"))])
                continue
            if isinstance(poll, WeightsPoll):
                self.waiting[peer] = poll.have_version
                if self.version >= 0:
                    await self._answer()


class WeightsSubscriber:
    """Sampler side: receives every newer version as it is published; ``take`` hands the
    newest not yet applied to the engine (older ones it replaced are never applied)."""

    def __init__(self, sock: AsyncSocket) -> None:
        self.sock = sock  # a DEALER connected to the learner's weights ROUTER
        self.received = -1  # newest version received (applied or not); -1: none yet
        self._newest: tuple[int, dict[str, torch.Tensor]] | None = None  # received, not taken
        self._arrived = anyio.Event()  # set and replaced at every arrival
        self.error = ""  # the last malformed weights message, for the actor's status

    async def wait_for(self, version: int) -> None:
        """Return once weights of ``version`` or newer have been received."""
        while self.received < version:
            await self._arrived.wait()

    def take(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest received weights not taken yet, or None. The tensors are read-only
        views of the received frames: copy them into the engine, never write to them."""
        newest, self._newest = self._newest, None
        return newest

    async def serve(self) -> None:
        """Long-poll for newer weights until cancelled."""
        codec: Codec[FromLearnerWeights] = Codec(FromLearnerWeights)
        poll = True
        while True:
            if poll:
                await self.sock.send_multipart([encode(WeightsPoll(have_version=self.received))])
            poll = True
            try:
                header, tensors = _bucket(codec, await self.sock.recv_multipart(copy=False))
                if header.bucket != 0:  # the rest of a version given up on: not an answer
                    poll = False
                    continue
                for i in range(1, header.buckets):
                    more, part = _bucket(codec, await self.sock.recv_multipart(copy=False))
                    if (more.version, more.bucket, more.buckets) != (header.version, i,
                                                                     header.buckets):
                        raise DecodeError(f"weights version {header.version}: bucket {i} of "
                                          f"{header.buckets} expected, got {more.bucket} of "
                                          f"version {more.version}")
                    tensors.update(part)
            except (DecodeError, ValueError) as exc:
                self.error = str(exc)[:200]
                await anyio.sleep(1.0)  # a broken learner: do not spin on it
                continue
            self._newest = (header.version, tensors)
            self.received = header.version
            self._arrived.set()
            self._arrived = anyio.Event()


def split_buckets(tensors: list[tuple[str, torch.Tensor]], limit: int
                  ) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``tensors`` of at most ``limit`` bytes each (0: all in one); a
    tensor larger than ``limit`` is a bucket of its own. Always at least one bucket."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if limit and buckets[-1] and size + n > limit:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += n
    return buckets


def _bucket(codec: Codec[FromLearnerWeights], frames: list) -> tuple[WeightsHeader,
                                                                     dict[str, torch.Tensor]]:
    """One message of a version: its header and its tensors (read-only views of the frames)."""
    header = codec.decode(frames[0].buffer)
    if not isinstance(header, WeightsHeader) or len(frames) != len(header.tensors) + 1:
        raise DecodeError("weights header does not match its frames")
    if not 0 <= header.bucket < header.buckets:
        raise DecodeError(f"weights bucket {header.bucket} of {header.buckets}")
    return header, {m.name: from_buffer(m.dtype, m.shape, f.buffer)
                    for m, f in zip(header.tensors, frames[1:], strict=True)}
