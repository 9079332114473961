"""The one weights channel: the learner publishes versioned weights, samplers subscribe.

Today the transport is ZeroMQ: the learner binds a ROUTER (``learner.weights_address``), each
sampler connects a DEALER and long-polls with ``WeightsPoll(have_version)``; the learner answers
as soon as it holds a newer version (at once for a sampler that has none) with a header frame
and one zero-copy frame per tensor. A slow sampler therefore only ever receives the newest
weights, never a queue of stale ones. Other transports (shared memory on one host, NCCL or
CUDA IPC on GPUs, in-flight updates) plug in behind ``WeightsPublisher.publish`` and
``WeightsSubscriber.take`` without either actor changing.
"""

from __future__ import annotations

import anyio
import torch

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
        self.version = -1  # the version of ``frames``; -1 until the first publish
        self.frames: list = []  # [header, tensor bytes...] of ``version``
        self.waiting: dict[bytes, int] = {}  # poller identity -> version it has
        self.have: dict[bytes, int] = {}  # every poller -> the newest version it said it has
        self._polled = anyio.Event()  # set and replaced at every poll
        self.sent = 0  # weight messages sent, all pollers together

    async def publish(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Make ``tensors`` the newest weights and send them to every poller waiting for them."""
        header = WeightsHeader(version=version, tensors=[meta(n, t) for n, t in tensors])
        self.version = version
        self.frames = [encode(header), *(raw_bytes(t) for _, t in tensors)]
        await self._answer()

    async def _answer(self) -> None:
        for peer, have in list(self.waiting.items()):
            if self.version > have:
                del self.waiting[peer]
                await self.sock.send_multipart([peer, *self.frames], copy=False)
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
                self.have[peer] = poll.have_version
                self._polled.set()
                self._polled = anyio.Event()
                if self.version >= 0:
                    await self._answer()

    async def wait_received(self, timeout_s: float) -> bool:
        """Wait until every sampler that ever polled has the newest weights (a subscriber polls
        again as soon as it receives a version), at most ``timeout_s`` (a dead one never will);
        True when all have them. Run ``serve`` beside it."""
        with anyio.move_on_after(timeout_s):
            while any(v < self.version for v in self.have.values()):
                await self._polled.wait()
            return True
        return False


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
        while True:
            await self.sock.send_multipart([encode(WeightsPoll(have_version=self.received))])
            frames = await self.sock.recv_multipart(copy=False)
            try:
                header = codec.decode(frames[0].buffer)
                if not isinstance(header, WeightsHeader) or len(frames) != len(header.tensors) + 1:
                    raise DecodeError("weights header does not match its frames")
                tensors = {m.name: from_buffer(m.dtype, m.shape, f.buffer)
                           for m, f in zip(header.tensors, frames[1:], strict=True)}
            except (DecodeError, ValueError) as exc:
                self.error = str(exc)[:200]
                await anyio.sleep(1.0)  # a broken learner: do not spin on it
                continue
            self._newest = (header.version, tensors)
            self.received = header.version
            self._arrived.set()
            self._arrived = anyio.Event()
