"""The nccl weights transport's control flow between two real processes, with gloo standing in
for NCCL (CPU tensors; the same ``TorchGroup`` code builds a ``ProcessGroupNCCL`` on CUDA): a
sampler joins its transfer group at its first version and keeps it across versions; a receiver
that fails half-way closes its group, the learner's transfer fails (not hangs) and the next poll
brings a new group in which the version arrives whole; a sampler killed and started again is a
new peer and joins a new group, while the dead one's group is dropped.

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
                procs.append(start(address, tmp_path, "1"))
                for version in (0, 1, 2):
                    await publish_all(publisher, version)
                    assert same(await reports.received(tmp_path, procs[0], version), version)
                while publisher.transfers:  # noqa: ASYNC110 - the transfers' count, no event
                    await anyio.sleep(0.05)
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
                await until(publisher, lambda: publisher.have[list(publisher.have)[1]] >= 3)
                assert same(await reports.received(tmp_path, procs[1], 3), 3)
                await publisher.publish(4, tensors(4), bucket_bytes=BUCKET)  # the dead one's
                await until(publisher, lambda: publisher.have[list(publisher.have)[1]] >= 4)
                assert same(await reports.received(tmp_path, procs[1], 4), 4)
                assert sender.groups_made == 3 and len(sender.peers) == 1  # the dead one dropped
                tg.cancel_scope.cancel()
            publisher.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        zctx.destroy(linger=0)
