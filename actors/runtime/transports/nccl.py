"""``nccl``: weights broadcast GPU to GPU in a transfer group per sampler (written against
vLLM 0.32 and torch 2.13; on a CPU the same control flow runs over gloo, which the tests use).

Each sampler gets a group of its own with the learner's rank 0: world ``1 + ranks`` (its
engine's receiving workers, ``WeightsPoll.ranks``), the learner at rank 0 hosting the rendezvous
on a fresh port. Per version the channel sends the sampler a header (the tensors' names, dtypes
and shapes, and the group) and then the learner broadcasts the tensors in buckets of
``bucket_bytes``, followed by one all-reduce in which every receiver says it has them all.
Transfers run beside training (the channel starts each in its own task; the snapshot they send
is a copy). A receiver that fails drops its group and polls again saying it holds none
(``WeightsPoll.group = 0``): the learner drops its side and the next header brings a new group
(new port), while the learner's half of the failed transfer ends with an error when the peer's
process is gone, or at ``timeout_s`` when it is alive (gloo cannot be interrupted; NCCL's
``abort`` would end it at once). A restarted sampler is a new peer and so gets a new group; a
gone one's group is dropped when a send to it fails. Per-sampler groups cost one send per
sampler but need no re-forming of one big group whenever a sampler comes or goes.

A receiver that dies mid-version costs that version only, never the learner: every
wait of the learner's side is bounded by ``timeout_s`` and ends in an exception of that transfer
alone. On CUDA the groups are built with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (a timeout or a
peer's error aborts the communicator; torch's default, 3, tears the whole process down from its
watchdog thread), and each collective is waited for by polling its completion until
``timeout_s`` (a plain ``wait`` returns at once on CUDA: the host would read a flag the aborted
all-reduce never wrote). vLLM's trainer side has no timeout of its own: its packed producer is
driven here (``_send_pynccl``) on streams of the sampler's own group, each waited for until
``timeout_s``, then the communicator is aborted (``forget``); vLLM's cached producer streams
would be shared by every later transfer, so one stuck broadcast would block them all.

Versions on one group are sent one at a time and whole: the sampler's subscriber asks for the
next version only once its engine has taken this one's transfer to its end
(``actors/runtime/weights.py``), and each sampler's transfer sends the tensors of the version its
header named (kept with the peer), not whatever was published since. On CUDA the learner's
snapshot was written by another thread's stream: a CUDA event recorded when the version is
prepared is waited for on the streams that read it.

Receivers: with ``receiver = ""`` (the hf engine) the sampler itself joins a torch.distributed
group (``ProcessGroupNCCL`` on CUDA, ``ProcessGroupGloo`` on the CPU, neither the default group)
and receives into fresh tensors on its device, handed to the engine as a mapping while the old
weights keep generating. With ``receiver = PYNCCL`` the engine's own workers receive: vLLM's
``NCCLWeightTransferEngine`` (``init_weight_transfer_engine`` with ``rank_offset`` 1, packed
buffers), straight into the running model through its layerwise reload; the learner then sends
with vLLM's own trainer side (``nccl_common.trainer_init``, ``packed_nccl_broadcast_producer``),
since vLLM's PyNccl communicator and a torch process group cannot share a group. vLLM's NCCL
engine is CUDA-only (PyNccl): it cannot run on gloo. On a CPU the
engine's workers receive with flowrl's own weight-transfer engine (``engines/vllm/transfer.py``),
which speaks this module's torch protocol. How an engine's workers take the transfer is the
engine's (``engines/vllm/receive.py``): this receiver hands it the group (``GroupBroadcast``).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import torch
import torch.distributed as dist

from actors.runtime.devices import indexed, on_device
from actors.runtime.ranks import free_port
from actors.runtime.tensors import _TORCH, meta
from actors.runtime.transports.base import ReceiveInto, Receiver, Sender
from actors.runtime.transports.sources import GroupBroadcast, WeightsSource, WorkerTransfer
from messages.codec import encode
from messages.tensor import TensorMeta
from messages.weights import AdapterSpec, TransferGroup, WeightsHeader, WeightsPoll

if TYPE_CHECKING:
    from actors.runtime.config import LearnerConfig

PYNCCL = "pynccl"  # WeightsPoll.receiver: vLLM's NCCL engine in the engine's workers (packed)
PACKED_BUFFER_BYTES = 1 << 30  # vLLM's packed broadcast: bytes per buffer (its default)
PACKED_BUFFERS = 2  # vLLM's packed broadcast: buffers in flight (its default)
POLL_S = 0.001  # how often a CUDA collective's completion is checked while waiting for it
_ENV = threading.Lock()  # one group built at a time under the variable below


@contextmanager
def _errors_abort_the_group() -> Iterator[None]:
    """Build a ``ProcessGroupNCCL`` whose timeouts and peer errors abort its communicator and
    raise in the waiting thread, and never take the process down (torch reads the variable in
    the group's constructor only; its default, 3, kills the process from the watchdog)."""
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    with _ENV:
        before = os.environ.get(key)
        os.environ[key] = "2"  # CleanUpOnly: abort the communicator, keep the process
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = before


class TorchGroup:
    """A torch.distributed process group of its own (not the default group, which is the
    learner's FSDP group), over a TCPStore that rank 0 hosts."""

    def __init__(self, g: TransferGroup, rank: int, device: torch.device, timeout_s: float):
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(g.address, g.port, g.world, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(f"flowrl-weights-{g.port}", store)
        self.cuda = device.type == "cuda"
        self.timeout_s = timeout_s
        if self.cuda:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            with _errors_abort_the_group():
                self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, g.world, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, g.world, timeout)
        self.store = store  # the rendezvous lives as long as the group

    def broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.pg.broadcast([t], opts))

    def all_have(self, ok: bool, device: torch.device) -> bool:
        """True when every member says it has the version (raises when one is gone)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self._wait(self.pg.allreduce([flag], opts))
        return bool(flag.item())

    def _wait(self, work: Any) -> None:
        """Until ``work`` is done, or raise: gloo's ``wait`` blocks (up to the group's
        timeout); NCCL's returns at once, so its completion is polled, up to ``timeout_s``,
        after which the group is aborted (a watchdog's abort completes it with its error)."""
        if self.cuda:
            deadline = time.monotonic() + self.timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(f"a weights collective waited over {self.timeout_s} s")
                time.sleep(POLL_S)
        work.wait()  # raises the collective's error (an aborted communicator's too)

    def close(self) -> None:
        for end in ("abort", "shutdown"):  # NCCL: abort ends what is in flight at once
            try:
                getattr(self.pg, end)()
                return
            except (RuntimeError, AttributeError):
                continue


def buckets_of(metas: list[TensorMeta], limit: int) -> list[list[TensorMeta]]:
    """``metas`` in consecutive runs of at most ``limit`` bytes (0: one run); both sides cut the
    stream the same way from the header alone."""
    out: list[list[TensorMeta]] = [[]]
    size = 0
    for m in metas:
        n = m.nbytes()
        if limit and out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].append(m)
        size += n
    return out


@dataclass
class _Version:
    """One version as the learner sends it: its tensors, and on CUDA the event after which
    they are written (the snapshot came from another thread's stream)."""

    version: int
    tensors: list[tuple[str, torch.Tensor]]
    ready: Any = None  # torch.cuda.Event, or None on a CPU


@dataclass
class _Peer:
    """The learner's side of one sampler's group."""

    group: TransferGroup
    ranks: int = 1
    receiver: str = ""
    joined: Any = None  # the open group (TorchGroup or vLLM's PyNcclCommunicator), once joined
    sending: _Version | None = None  # the version its last header named (what transfer sends)
    streams: list[Any] = field(default_factory=list)  # pynccl: this group's producer streams


class BroadcastSender(Sender):
    name = "nccl"
    moves_bytes = True

    def __init__(self, address: str = "127.0.0.1", timeout_s: float = 600.0,
                 device: torch.device | str = "cpu") -> None:
        self.address = address  # where samplers reach this learner's rendezvous
        self.timeout_s = timeout_s
        self.device = indexed(device)
        self.peers: dict[bytes, _Peer] = {}
        self.polls: dict[bytes, WeightsPoll] = {}  # the latest poll of each sampler
        self.newest = _Version(-1, [])  # the newest version prepared
        self.bucket_bytes = 0
        self.adapter: AdapterSpec | None = None  # the version's adapter spec (LoRA), or None
        self.groups_made = 0  # groups formed, all samplers together (rejoins included)

    @classmethod
    def build(cls, learner: LearnerConfig, device: torch.device) -> BroadcastSender:
        """Samplers reach the rendezvous at the weights address's host (127.0.0.1 for ipc:// or
        a wildcard)."""
        address = learner.weights_address
        host = address.removeprefix("tcp://").rpartition(":")[0] \
            if address.startswith("tcp://") else ""
        return cls(host if host and host not in ("*", "0.0.0.0") else "127.0.0.1",
                   learner.collective_timeout_s, device)

    async def prepare(self, version: int, tensors: list[tuple[str, torch.Tensor]], *,
                      bucket_bytes: int = 0, adapter: AdapterSpec | None = None
                      ) -> list[list]:
        ready = None
        if self.device.type == "cuda":  # the snapshot's writes, on the stream that made them
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self.newest = _Version(version, [(n, t.contiguous()) for n, t in tensors], ready)
        self.bucket_bytes, self.adapter = bucket_bytes, adapter
        return []  # each sampler's header names its own group: ``messages_for``

    def polled(self, peer: bytes, poll: WeightsPoll) -> None:
        self.polls[peer] = poll
        held = self.peers.get(peer)
        if held is not None and poll.group != held.group.port and held.joined is not None:
            self.forget(peer)  # it lost the group (its side failed): form a new one

    def messages_for(self, peer: bytes, messages: list[list]) -> list[list]:
        held = self.peers.get(peer)
        if held is None:
            poll = self.polls.get(peer, WeightsPoll(have_version=-1))
            held = self.peers[peer] = _Peer(
                TransferGroup(address=self.address, port=free_port(), world=1 + poll.ranks,
                              bucket_bytes=self.bucket_bytes), poll.ranks, poll.receiver)
            self.groups_made += 1
        held.sending = self.newest  # what its transfer sends, whatever is published meanwhile
        return [[encode(WeightsHeader(version=self.newest.version, transport=self.name,
                                      tensors=[meta(n, t) for n, t in self.newest.tensors],
                                      group=held.group, adapter=self.adapter))]]

    async def transfer(self, version: int, peer: bytes) -> bool:
        held = self.peers[peer]
        sending = held.sending  # (the version of the header this transfer follows)
        if sending is None:
            return False
        try:
            await anyio.to_thread.run_sync(on_device(self.device, self._send), held, sending,
                                           abandon_on_cancel=True)
            return True
        except (RuntimeError, OSError, ValueError, TimeoutError):
            if self.peers.get(peer) is held:  # (a poll may have replaced it meanwhile)
                self.forget(peer)  # failed or gone: its next poll forms a new group
            return False

    def _send(self, held: _Peer, sending: _Version) -> None:
        if held.receiver == PYNCCL:
            return self._send_pynccl(held, sending)
        if held.joined is None:
            held.joined = TorchGroup(held.group, 0, self.device, self.timeout_s)
        if sending.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(sending.ready)
        metas = [meta(n, t) for n, t in sending.tensors]
        values = dict(sending.tensors)
        for bucket in buckets_of(metas, held.group.bucket_bytes):
            flat = torch.cat([values[m.name].reshape(-1).view(torch.uint8) for m in bucket])
            held.joined.broadcast(flat)
        if not held.joined.all_have(True, self.device):
            raise RuntimeError("a receiver did not take the version")

    def _send_pynccl(self, held: _Peer, sending: _Version) -> None:
        """vLLM's trainer side: PyNccl at rank 0 of the group, packed broadcast in the order of
        the header's names (the worker's ``packed_nccl_broadcast_consumer`` mirrors it: buffers
        cut by ``pack_tensors`` at ``PACKED_BUFFER_BYTES``), as vLLM's
        ``packed_nccl_broadcast_producer`` does, but on this group's own streams, each waited
        for at most until ``timeout_s`` (a dead receiver's broadcast never completes: the
        caller aborts the communicator, and no other group's transfer waits behind it)."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

        if held.joined is None:
            g = held.group
            held.joined = trainer_init({"master_address": g.address, "master_port": g.port,
                                        "world_size": g.world})
            held.streams = [torch.cuda.Stream(self.device) for _ in range(PACKED_BUFFERS)]
        deadline = time.monotonic() + self.timeout_s
        items = iter(sending.tensors)
        in_flight: list[Any] = [None] * PACKED_BUFFERS  # a buffer lives until its stream is done
        i = 0
        while True:
            stream = held.streams[i]
            _drained(stream, deadline)
            in_flight[i] = None
            with torch.cuda.stream(stream):
                if sending.ready is not None:  # the snapshot is written before it is packed
                    stream.wait_event(sending.ready)
                chunk = pack_tensors(items, lambda item: item[1], PACKED_BUFFER_BYTES)
                if chunk is None:
                    break
                held.joined.broadcast(chunk.packed_tensor, src=0, stream=stream)
                in_flight[i] = chunk
            i = (i + 1) % PACKED_BUFFERS
        for stream in held.streams:
            _drained(stream, deadline)

    def forget(self, peer: bytes) -> None:
        held = self.peers.pop(peer, None)
        if held is not None and held.joined is not None:
            close = getattr(held.joined, "close", None) or held.joined.destroy
            close()

    def close(self) -> None:
        for peer in list(self.peers):
            self.forget(peer)


def _drained(stream: Any, deadline: float) -> None:
    """Return once everything queued on ``stream`` has run; TimeoutError after ``deadline``."""
    while not stream.query():
        if time.monotonic() > deadline:
            raise TimeoutError("a weights broadcast did not complete before "
                               "learner.collective_timeout_s")
        time.sleep(POLL_S)


class BroadcastReceiver(Receiver):
    name = "nccl"
    worker_via = GroupBroadcast

    def __init__(self, device: torch.device | str = "cpu", in_worker: bool = False,
                 ranks: int = 1, timeout_s: float = 600.0) -> None:
        self.device = indexed(device)  # where received tensors go (not in_worker)
        self.in_worker = in_worker  # the engine's workers receive (vLLM)
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.group: TransferGroup | None = None  # the group held (joined, or handed to vLLM)
        self.joined: TorchGroup | None = None

    @classmethod
    def build(cls, into: ReceiveInto) -> BroadcastReceiver:
        return cls(into.device, into.in_worker, into.ranks, into.timeout_s)

    @property
    def pynccl(self) -> bool:
        """The engine's workers receive with vLLM's NCCL engine (on CUDA: the packed protocol);
        on a CPU with this module's torch protocol (``engines/vllm/transfer.py``)."""
        return self.in_worker and self.device.type == "cuda"

    def poll_fields(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "receiver": PYNCCL if self.pynccl else "",
                "group": self.group.port if self.group is not None else 0}

    async def receive(self, header: WeightsHeader, parts: dict[str, torch.Tensor]
                      ) -> WeightsSource:
        g = header.group
        if g is None:
            raise ValueError("nccl weights header without a group")
        if self.in_worker:
            return self._worker_transfer(header, g)
        try:
            return await anyio.to_thread.run_sync(self._receive, header, g,
                                                  abandon_on_cancel=True)
        except BaseException:
            self.drop()  # the learner sees the group close and forms a new one
            raise

    def _receive(self, header: WeightsHeader, g: TransferGroup) -> dict[str, torch.Tensor]:
        if self.group != g:
            self.drop()
            self.joined = TorchGroup(g, g.rank, self.device, self.timeout_s)
            self.group = g
        assert self.joined is not None
        out: dict[str, torch.Tensor] = {}
        for bucket in buckets_of(header.tensors, g.bucket_bytes):
            flat = torch.empty(sum(m.nbytes() for m in bucket), dtype=torch.uint8,
                               device=self.device)
            self.joined.broadcast(flat)
            offset = 0
            for m in bucket:
                n = m.nbytes()
                out[m.name] = flat[offset:offset + n].view(_TORCH[m.dtype]).view(m.shape)
                offset += n
        self.joined.all_have(True, self.device)
        return out

    def _worker_transfer(self, header: WeightsHeader, g: TransferGroup) -> WorkerTransfer:
        joins = self.group != g  # a new group: the workers join it at rank_offset g.rank
        self.group = g

        def done(exc: BaseException | None) -> None:  # (in the sampler's event loop)
            if exc is not None:
                self.group = None  # the next header brings a new group

        return WorkerTransfer(header.tensors, GroupBroadcast(g, joins, self.pynccl,
                                                             self.timeout_s), done)

    def drop(self) -> None:
        if self.joined is not None:
            self.joined.close()
        self.joined, self.group = None, None

    def close(self) -> None:
        self.drop()

