"""A sampler's side of the nccl weights transport in a test, over gloo on the CPU:
``python -m tests.transfer_worker ADDRESS REPORTS OUT [fail:VERSION | die:VERSION]``. It
subscribes to the learner's weights channel at ADDRESS, writes every version it receives to
``OUT/PID-vVERSION.safetensors`` and then reports ``PID VERSION`` to the test (a PUSH socket
connected to REPORTS). ``FLOWRL_TEST_DEVICE`` (default cpu) is where it receives. With
``fail:VERSION``, its receiver fails once in the middle of that version's broadcast (after the
first bucket), as a receiver whose device ran out of memory would: it must close its group, and
receive the version in a new one. With ``die:VERSION`` the process is killed (SIGKILL) there
instead, mid-version, as a sampler that crashes would be."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import anyio
import torch
import zmq
from safetensors.torch import save_file

from actors.runtime.transports import nccl
from actors.runtime.transports.base import ReceiveInto
from actors.runtime.weights import WeightsSubscriber
from actors.runtime.zmq_bridge import make_socket


def inject_failure(version: int, die: bool = False) -> None:
    """The second broadcast of ``version`` raises, once (``die``: kills this process)."""
    state = {"calls": 0, "failed": False}
    receive = nccl.BroadcastReceiver._receive
    broadcast = nccl.TorchGroup.broadcast

    def counting_receive(self, header, g):
        state["calls"] = 0 if header.version == version else -100
        return receive(self, header, g)

    def failing_broadcast(self, t):
        state["calls"] += 1
        if state["calls"] == 2 and not state["failed"]:
            state["failed"] = True
            if die:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected: the receiver failed half-way")
        return broadcast(self, t)

    nccl.BroadcastReceiver._receive = counting_receive  # type: ignore[method-assign]
    nccl.TorchGroup.broadcast = failing_broadcast  # type: ignore[method-assign]


async def main(address: str, reports: str, out: Path) -> None:
    zctx = zmq.Context()
    with make_socket(zctx, zmq.DEALER, connect=address) as sock, \
         make_socket(zctx, zmq.PUSH, connect=reports) as report:
        sub = WeightsSubscriber(sock, into=ReceiveInto(
            device=os.environ.get("FLOWRL_TEST_DEVICE", "cpu"), timeout_s=30))
        async with anyio.create_task_group() as tg:
            tg.start_soon(sub.serve)
            while True:
                await sub.wait_for(sub.received + 1)
                got = sub.take()
                assert got is not None
                version, tensors = got
                path = out / f"{os.getpid()}-v{version}.safetensors"
                save_file({n: t.to("cpu", copy=True) for n, t in tensors.items()},
                          str(path) + ".partial")
                os.replace(str(path) + ".partial", path)
                await report.send_multipart([f"{os.getpid()} {version}".encode()])


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) > 4:
        how, version = sys.argv[4].split(":")
        inject_failure(int(version), die=how == "die")
    anyio.run(main, sys.argv[1], sys.argv[2], Path(sys.argv[3]), backend="trio")
