"""The subscriber's hand-off of a version its engine's workers receive, on
gloo: a receiver slower than two publishes still ends up with weights equal to the version it
reports, and a GPU transfer that can never work fails the sampler instead of polling forever.

The learner's side is the real publisher and nccl sender (gloo here); the sampler's side is the
real subscriber with ``in_worker`` set, so each version arrives as a ``WorkerTransfer`` for the
engine's own workers to receive, as vLLM's do. Standing in for vLLM's worker, the test runs
each transfer through the nccl receiver's own group code (``BroadcastReceiver._receive``: join
at the transfer's init, buckets, the closing all-reduce), the protocol ``flowrl_gloo`` speaks
inside vLLM (``actors/sampler/engines/vllm/transfer.py``; a vLLM job over it is in
``tests/test_vllm_jobs.py``)."""

from __future__ import annotations

import anyio
import pytest
import torch
import zmq

from actors.runtime.transports.base import ReceiveInto
from actors.runtime.transports.nccl import BroadcastReceiver, BroadcastSender
from actors.runtime.transports.sources import GroupBroadcast, WorkerTransfer
from actors.runtime.weights import TransfersFailing, WeightsPublisher, WeightsSubscriber
from actors.runtime.zmq_bridge import make_socket
from messages.codec import Codec, encode
from messages.tensor import TensorMeta
from messages.weights import ToLearnerWeights, TransferGroup, WeightsHeader, WeightsPoll
from tests.test_weights_nccl import BUCKET, same, tensors


class Worker:
    """An engine whose own worker receives each version's transfer (vLLM's role), one transfer
    at a time, each run only once ``gate`` is open (vLLM's load waits for its requests to end,
    or for a validation holding the weights lock)."""

    def __init__(self, sub: WeightsSubscriber) -> None:
        self.sub = sub
        self.receiver = BroadcastReceiver()  # the group code of the worker's side
        self.group: TransferGroup | None = None
        self.version = -1  # what it reports
        self.weights: dict[str, torch.Tensor] = {}  # what it holds
        self.loads: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.gate = anyio.Event()
        self.gate.set()
        self.loaded = anyio.Event()  # set and replaced at every load

    def receive(self, version: int, t: WorkerTransfer) -> dict[str, torch.Tensor]:
        assert isinstance(t.via, GroupBroadcast) and not t.via.packed  # gloo: torch's protocol
        if t.via.joins:  # a new group: join it at its rank
            self.group = t.via.group
        assert self.group is not None
        header = WeightsHeader(version=version, transport=BroadcastReceiver.name,
                               tensors=t.tensors)
        return self.receiver._receive(header, self.group)

    async def run(self) -> None:
        while True:
            got = self.sub.take()
            if got is None:
                await self.sub.wait_for(self.sub.received + 1)
                continue
            version, source = got
            assert isinstance(source, WorkerTransfer)
            await self.gate.wait()  # taken, not run yet (vLLM's load waiting for its engine)
            try:
                weights = await anyio.to_thread.run_sync(self.receive, version, source)
            except BaseException as exc:
                source.done(exc)
                raise
            source.done(None)
            self.version, self.weights = version, weights
            self.loads.append((version, weights))
            self.loaded.set()
            self.loaded = anyio.Event()

    async def wait_version(self, version: int) -> None:
        while self.version < version:
            await self.loaded.wait()


@pytest.mark.anyio
async def test_a_receiver_slower_than_two_publishes_holds_the_version_it_reports(sockets):
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    try:
        with anyio.fail_after(120), make_socket(zctx, zmq.ROUTER, bind=address) as lsock, \
             make_socket(zctx, zmq.DEALER, connect=address) as ssock:
            publisher = WeightsPublisher(lsock, BroadcastSender(address="127.0.0.1",
                                                                timeout_s=60))
            sub = WeightsSubscriber(ssock, BroadcastReceiver.name,
                                    ReceiveInto(in_worker=True, timeout_s=60))
            worker = Worker(sub)
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.serve)
                tg.start_soon(sub.serve)
                tg.start_soon(worker.run)
                await publisher.publish(0, tensors(0), bucket_bytes=BUCKET)
                await worker.wait_version(0)
                worker.gate = anyio.Event()  # the engine is busy: no load for a while
                await publisher.publish(1, tensors(1), bucket_bytes=BUCKET)
                await sub.wait_for(1)
                await publisher.publish(2, tensors(2), bucket_bytes=BUCKET)
                # version 1's transfer is started on the learner's side and not ended on the
                # engine's: the subscriber has not asked for version 2 (it would take its place)
                assert sub.handing_off == 1 and sub.received == 1
                assert publisher.have[next(iter(publisher.have))] == 0
                worker.gate.set()
                await worker.wait_version(2)
                await publisher.wait_transfers()
                tg.cancel_scope.cancel()
            assert [v for v, _ in worker.loads] == [0, 1, 2]
            for version, weights in worker.loads:  # each load holds the version it reports
                assert same(weights, version), version
            assert publisher.failed == 0 and publisher.sender.groups_made == 1
            publisher.close()
            sub.close()
            worker.receiver.close()
    finally:
        zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_transfers_that_keep_failing_fail_the_sampler(sockets):
    """A header whose group can never be joined (here nothing listens at its port; on GPUs,
    two ranks of one NCCL group on one GPU) fails ``FAILED_IN_A_ROW`` times, then the
    subscriber raises: the sampler stops with the reason instead of polling forever."""
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    codec: Codec[ToLearnerWeights] = Codec(ToLearnerWeights)
    try:
        with anyio.fail_after(120), make_socket(zctx, zmq.ROUTER, bind=address) as lsock, \
             make_socket(zctx, zmq.DEALER, connect=address) as ssock:
            with socket_nobody_listens_on() as port:
                sub = WeightsSubscriber(ssock, BroadcastReceiver.name, ReceiveInto(timeout_s=1))

                async def learner() -> None:
                    version = 0
                    while True:  # every poll answered with a version in an unreachable group
                        peer, frame = await lsock.recv_multipart()
                        assert isinstance(codec.decode(frame), WeightsPoll)
                        await lsock.send_multipart([peer, encode(WeightsHeader(
                            version=version, transport=BroadcastReceiver.name,
                            tensors=[TensorMeta("w", "float32", (4,))],
                            group=TransferGroup(address="127.0.0.1", port=port, world=2)))])
                        version += 1

                with pytest.raises(ExceptionGroup) as raised:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(learner)
                        await sub.serve()
                assert raised.group_contains(TransfersFailing, match="3 transfers in a row")
                assert sub.failed == 3 and sub.received == -1
            sub.close()
    finally:
        zctx.destroy(linger=0)


class socket_nobody_listens_on:
    """A TCP port bound and never listened on (connections to it are refused)."""

    def __enter__(self) -> int:
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.s.close()
