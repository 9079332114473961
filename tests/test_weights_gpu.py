"""The GPU weights transports on CUDA (marker ``gpu``; not run in the session that wrote them,
which had no GPU): ``ipc`` from the learner's GPU to a sampler process on the same GPU, ``nccl``
between two GPUs through torch's ``ProcessGroupNCCL``. Both go through the same channel and
sampler-side worker (``tests/transfer_worker.py``) as the gloo test."""

from __future__ import annotations

import os
import subprocess
import sys

import anyio
import pytest
import torch
import zmq

from actors.runtime.transports.table import TRANSPORTS
from actors.runtime.weights import WeightsPublisher
from actors.runtime.zmq_bridge import make_socket
from tests.jobs import ROOT
from tests.test_weights_nccl import Reports, same, tensors, until

pytestmark = pytest.mark.gpu


def start_on(device: str, address: str, out: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.transfer_worker", address,
                             f"{address}-reports", out], cwd=ROOT,
                            env={**os.environ, "FLOWRL_TEST_DEVICE": device})


@pytest.mark.anyio
@pytest.mark.parametrize(("transport", "gpus"), [("ipc", 1), ("nccl", 2)])
async def test_versions_reach_a_sampler_on_cuda(sockets, tmp_path, transport, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA device(s)")
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    device = f"cuda:{gpus - 1}"  # the sampler's: the learner's own GPU (ipc) or another (nccl)
    options = {"device": torch.device("cuda:0")}
    if transport == "nccl":
        options.update(address="127.0.0.1", timeout_s=60)
    proc = start_on(device, address, str(tmp_path))
    try:
        with anyio.fail_after(240), make_socket(zctx, zmq.ROUTER, bind=address) as sock, \
             make_socket(zctx, zmq.PULL, bind=f"{address}-reports") as pull:
            reports = Reports(pull)
            publisher = WeightsPublisher(sock, TRANSPORTS[transport].load().sender(**options))
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.serve)
                for version in (0, 1, 2):
                    await publisher.publish(version, [(n, t.to("cuda:0"))
                                                      for n, t in tensors(version)])
                    await until(publisher, lambda v=version: max(publisher.have.values(),
                                                                 default=-1) >= v)
                    assert same(await reports.received(tmp_path, proc, version), version)
                tg.cancel_scope.cancel()
            publisher.close()
    finally:
        proc.kill()
        proc.wait()
        zctx.destroy(linger=0)
