"""The one weights channel: the learner publishes versioned weights, samplers subscribe.

The learner binds a ROUTER (``learner.weights_address``), each sampler connects a DEALER and
long-polls with ``WeightsPoll(have_version)``; the learner answers as soon as it holds a newer
version (at once for a sampler that has none). A slow sampler therefore only ever receives the
newest weights, never a queue of stale ones. Two transports carry the tensors:

- ``zmq`` (across hosts): one message per bucket of tensors (``learner.weights_bucket_mb``),
  each a header frame and one zero-copy frame per tensor; the sampler assembles the version and
  hands it to its engine whole.
- ``shm`` (samplers on the learner's host): the learner writes each version once as a
  safetensors file in ``/dev/shm`` and the header carries only its path; every sampler maps the
  file (``SharedWeights``), and a vLLM engine loads it straight from there. One write per step
  instead of one 540 MB message per sampler. The newest ``SHM_KEEP`` versions are kept (a
  sampler that took an older one finds it gone and waits for the next); the folder is removed
  when the learner exits, and a killed learner's folder by the next one. A sampler hard-links
  each version it receives into a folder of its own (no copy), so the version it holds stays
  loadable after the learner drops it.

NCCL or CUDA IPC on GPUs would plug in behind ``WeightsPublisher.publish`` and
``WeightsSubscriber.take`` the same way, without either actor changing.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import anyio
import torch
import zmq
from safetensors import SafetensorError

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

SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
SHM_PREFIX = "flowrl-weights-"
SHM_KEEP = 2  # versions kept in shared memory


class SharedWeights(Mapping[str, torch.Tensor]):
    """The tensors of a safetensors file in shared memory, read on access (``path`` lets an
    engine that reads files itself skip the tensors)."""

    def __init__(self, path: str) -> None:
        from safetensors import safe_open

        self.path = path
        if not Path(path).is_file():
            raise FileNotFoundError(path)  # removed: a newer version replaced it
        with safe_open(path, framework="pt") as f:
            self._names = list(f.keys())  # noqa: SIM118 - safe_open is not a dict

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def items(self):  # one open for all tensors
        from safetensors import safe_open

        with safe_open(self.path, framework="pt") as f:
            for name in self._names:
                yield name, f.get_tensor(name)


def remove_orphaned_shm() -> None:
    """Remove the shared-memory folders of learners and samplers that are gone (kill -9)."""
    for d in SHM_ROOT.glob(f"{SHM_PREFIX}*"):
        pid = d.name.removeprefix(SHM_PREFIX).split("-")[0]  # a learner's, or a sampler's links
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


class WeightsPublisher:
    """Learner side: holds the newest published weights and answers pollers that lack them."""

    def __init__(self, sock: AsyncSocket, transport: str = "zmq") -> None:
        self.sock = sock  # a ROUTER the samplers connect to
        # a full peer makes a send wait (not drop a bucket); a gone one fails it (EHOSTUNREACH)
        sock.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.transport = transport  # "zmq" or "shm"
        self.version = -1  # the version of ``messages``; -1 until the first publish
        self.messages: list[list] = []  # per bucket: [header, tensor bytes...] of ``version``
        self.waiting: dict[bytes, int] = {}  # poller identity -> version it has
        self.have: dict[bytes, int] = {}  # every poller -> the newest version it said it has
        self._polled = anyio.Event()  # set and replaced at every poll
        self.sent = 0  # weight messages sent, all pollers together
        self.shm_dir = SHM_ROOT / f"{SHM_PREFIX}{os.getpid()}"  # shm: this learner's files
        self.shm_files: list[Path] = []  # shm: the versions kept, oldest first

    async def publish(self, version: int, tensors: list[tuple[str, torch.Tensor]], *,
                      bucket_bytes: int = 0) -> None:
        """Make ``tensors`` the newest weights and send them to every poller waiting for them:
        zmq in messages of at most ``bucket_bytes`` of tensor data each (0: one message; a
        larger tensor travels alone), shm as one file whose path is the one message."""
        if self.transport == "shm":
            path = await anyio.to_thread.run_sync(self._write, version, tensors)
            self.messages = [[encode(WeightsHeader(version=version, tensors=[], path=str(path)))]]
        else:
            buckets = split_buckets(tensors, bucket_bytes)
            self.messages = [[encode(WeightsHeader(version=version,
                                                   tensors=[meta(n, t) for n, t in b],
                                                   bucket=i, buckets=len(buckets))),
                              *(raw_bytes(t) for _, t in b)] for i, b in enumerate(buckets)]
        self.version = version
        await self._answer()

    def _write(self, version: int, tensors: list[tuple[str, torch.Tensor]]) -> Path:
        from safetensors.torch import save_file

        self.shm_dir.mkdir(exist_ok=True)
        path = self.shm_dir / f"v{version}.safetensors"
        tmp = path.with_suffix(".partial")
        save_file({n: t.contiguous() for n, t in tensors}, str(tmp))
        os.replace(tmp, path)  # a sampler never maps a half-written file
        self.shm_files.append(path)
        while len(self.shm_files) > SHM_KEEP:
            self.shm_files.pop(0).unlink(missing_ok=True)
        return path

    def close(self) -> None:
        """Remove the shared-memory files (the samplers that mapped one keep their mapping)."""
        shutil.rmtree(self.shm_dir, ignore_errors=True)

    async def _answer(self) -> None:
        # a second _answer (a poll served while this one awaits a send) may have answered a
        # peer of this snapshot already: only a peer still waiting is answered here
        for peer, have in list(self.waiting.items()):
            if self.version > have and self.waiting.get(peer) == have:
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
        self._newest: tuple[int, Mapping[str, torch.Tensor]] | None = None  # received, not taken
        self._arrived = anyio.Event()  # set and replaced at every arrival
        self.error = ""  # the last malformed weights message, for the actor's status
        # shm: this sampler's own links to the learner's files, the newest SHM_KEEP kept, so a
        # version received stays loadable when the learner drops it (a newer one, or its exit)
        self.shm_dir = SHM_ROOT / f"{SHM_PREFIX}{os.getpid()}-links"
        self.links: list[Path] = []

    async def wait_for(self, version: int) -> None:
        """Return once weights of ``version`` or newer have been received."""
        while self.received < version:
            await self._arrived.wait()

    def take(self) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """The newest received weights not taken yet, or None. The tensors are read-only
        views of the received frames (or of a shared-memory file: ``SharedWeights``): copy
        them into the engine, never write to them."""
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
            tensors: Mapping[str, torch.Tensor]
            try:
                header, parts = _bucket(codec, await self.sock.recv_multipart(copy=False))
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
                    parts.update(part)
                tensors = (await anyio.to_thread.run_sync(self._claim, header.path)
                           if header.path else parts)
            except FileNotFoundError:  # shm: a newer version replaced it already; poll again
                continue
            except (DecodeError, ValueError, OSError, SafetensorError) as exc:
                self.error = str(exc)[:200]
                await anyio.sleep(1.0)  # a broken learner: do not spin on it
                continue
            self._newest = (header.version, tensors)
            self.received = header.version
            self._arrived.set()
            self._arrived = anyio.Event()

    def _claim(self, path: str) -> SharedWeights:
        """The learner's file of a version, through a hard link of this sampler's own (same
        filesystem: no copy), so that the learner removing its file cannot take it away."""
        own = self.shm_dir / Path(path).name
        self.shm_dir.mkdir(exist_ok=True)
        own.unlink(missing_ok=True)
        try:
            os.link(path, own)  # FileNotFoundError: gone already (a newer version replaced it)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            return SharedWeights(path)  # links refused here: read the learner's file itself
        if own in self.links:  # the same version again (a resumed learner): one entry, so
            self.links.remove(own)  # trimming an old entry never removes the new link
        self.links.append(own)
        while len(self.links) > SHM_KEEP:
            self.links.pop(0).unlink(missing_ok=True)
        return SharedWeights(str(own))

    def close(self) -> None:
        """Remove this sampler's links (an engine that mapped one keeps its mapping)."""
        shutil.rmtree(self.shm_dir, ignore_errors=True)


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
