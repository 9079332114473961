"""The nccl weights transport's control flow between two real processes, with gloo standing in
for NCCL (CPU tensors; the same ``TorchGroup`` code builds a ``ProcessGroupNCCL`` on CUDA): a
sampler joins its transfer group at its first version and keeps it across versions; a receiver
that fails half-way closes its group, the learner's transfer fails (not hangs) and the next poll
brings a new group in which the version arrives whole; a sampler killed and started again is a
new peer and joins a new group, while the dead one's group is dropped; a sampler killed in the
middle of a version costs that version only: another sampler gets it, the
learner's channel goes on, and the restarted sampler joins a new group.

Not exercised here: vLLM's side (``receiver = "vllm"``: its NCCL weight-transfer engine runs on
PyNccl, CUDA only) and the CUDA process group itself; see the module's docstring."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import torch
import zmq
from safetensors.torch import load_file

from actors.runtime.transports.nccl import BroadcastSender
from actors.runtime.weights import WeightsPublisher
from actors.runtime.zmq_bridge import make_socket
from tests.jobs import ROOT

BUCKET = 2 * 16 * 16 * 4  # two tensors per broadcast: a version is 4 broadcasts


def tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    return [(f"layer{i}.weight", torch.full((16, 16), float(version * 100 + i)))
            for i in range(7)]


def start(address: str, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.transfer_worker", address,
                             f"{address}-reports", str(out), *extra], cwd=ROOT)


async def until(publisher: WeightsPublisher, done: Callable[[], bool]) -> None:
    """Wait (on the publisher's polls) until ``done()``."""
    while not done():
        await publisher._polled.wait()


class Reports:
    """What the sampler processes say they wrote (``PID VERSION``), as they say it."""

    def __init__(self, sock) -> None:
        self.sock, self.seen = sock, set()

    async def received(self, out: Path, proc: subprocess.Popen, version: int
                       ) -> dict[str, torch.Tensor]:
        """What ``proc`` received of ``version`` (once it has reported writing it)."""
        while (proc.pid, version) not in self.seen:
            pid, v = (await self.sock.recv_multipart())[0].decode().split()
            self.seen.add((int(pid), int(v)))
        return load_file(str(out / f"{proc.pid}-v{version}.safetensors"))


def same(got: dict[str, torch.Tensor], version: int) -> bool:
    return list(got) == [n for n, _ in tensors(version)] and all(
        torch.equal(got[n], t) for n, t in tensors(version))


async def publish_all(publisher: WeightsPublisher, version: int) -> None:
    await publisher.publish(version, tensors(version), bucket_bytes=BUCKET)
    await until(publisher, lambda: max(publisher.have.values(), default=-1) >= version)


@pytest.mark.anyio
async def test_versions_a_failing_receiver_and_a_restarted_sampler(sockets, tmp_path):
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    procs: list[subprocess.Popen] = []
    try:
        with anyio.fail_after(240), make_socket(zctx, zmq.ROUTER, bind=address) as sock, \
             make_socket(zctx, zmq.PULL, bind=f"{address}-reports") as pull:
            reports = Reports(pull)
            # gloo cannot be interrupted while it waits for a peer whose process is alive: the
            # learner's side of a failed transfer ends at this timeout (NCCL's abort ends it)
            publisher = WeightsPublisher(sock, BroadcastSender(address="127.0.0.1", timeout_s=5))
            sender = publisher.sender
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.serve)
                # a receiver that fails half-way through version 1
                procs.append(start(address, tmp_path, "fail:1"))
                for version in (0, 1, 2):
                    await publish_all(publisher, version)
                    assert same(await reports.received(tmp_path, procs[0], version), version)
                await publisher.wait_transfers()
                assert publisher.failed == 1  # version 1's first transfer
                assert sender.groups_made == 2  # its first group, then the one after the failure
                first_group = next(iter(sender.peers.values())).group.port
                await publish_all(publisher, 3)  # a good transfer keeps the group
                assert next(iter(sender.peers.values())).group.port == first_group
                # the sampler is killed; another starts (a restart) and gets the newest version
                procs[0].kill()
                procs[0].wait()
                procs.append(start(address, tmp_path))
                await until(publisher, lambda: len(publisher.have) == 2)
                restarted = list(publisher.have)[1]
                await until(publisher, lambda: publisher.have[restarted] >= 3)
                assert same(await reports.received(tmp_path, procs[1], 3), 3)
                await publisher.publish(4, tensors(4), bucket_bytes=BUCKET)  # the dead one's
                await until(publisher, lambda: publisher.have[restarted] >= 4)
                assert same(await reports.received(tmp_path, procs[1], 4), 4)
                assert sender.groups_made == 3 and len(sender.peers) == 1  # the dead one dropped
                assert list(publisher.have) == [restarted]  # and not waited for at the end
                tg.cancel_scope.cancel()
            publisher.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        zctx.destroy(linger=0)


@pytest.mark.anyio
async def test_a_receiver_killed_mid_version_costs_that_version_only(sockets, tmp_path):
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    procs: list[subprocess.Popen] = []
    try:
        with anyio.fail_after(240), make_socket(zctx, zmq.ROUTER, bind=address) as sock, \
             make_socket(zctx, zmq.PULL, bind=f"{address}-reports") as pull:
            reports = Reports(pull)
            # a long timeout: a dead peer's sockets close, so its transfer fails at once
            publisher = WeightsPublisher(sock, BroadcastSender(address="127.0.0.1", timeout_s=120))
            sender = publisher.sender
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.serve)
                dying, steady = start(address, tmp_path, "die:1"), start(address, tmp_path)
                procs += [dying, steady]
                await until(publisher, lambda: len(publisher.have) == 2)
                await publish_all(publisher, 0)
                for p in (dying, steady):
                    assert same(await reports.received(tmp_path, p, 0), 0)
                await publisher.publish(1, tensors(1), bucket_bytes=BUCKET)
                assert same(await reports.received(tmp_path, steady, 1), 1)
                assert await anyio.to_thread.run_sync(dying.wait) == -9  # killed mid-version
                await publisher.wait_transfers()
                assert publisher.failed == 1  # the dead one's version 1, nothing else
                assert len(sender.peers) == 1  # its group dropped
                await publisher.publish(2, tensors(2), bucket_bytes=BUCKET)  # the channel goes on
                assert same(await reports.received(tmp_path, steady, 2), 2)
                restarted = start(address, tmp_path)
                procs.append(restarted)
                assert same(await reports.received(tmp_path, restarted, 2), 2)  # a new group
                await publish_all(publisher, 3)
                for p in (steady, restarted):
                    assert same(await reports.received(tmp_path, p, 3), 3)
                await publisher.wait_transfers()
                assert publisher.failed == 1 and sender.groups_made == 3
                assert len(sender.peers) == 2
                tg.cancel_scope.cancel()
            publisher.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        zctx.destroy(linger=0)
