"""How the vLLM engine's workers take a GPU transfer (``engines/vllm/receive.py``), from what
the nccl and ipc receivers hand it: vLLM's backend per transport and device, and the
``init_weight_transfer_engine`` / ``update_weights`` arguments of each version, a new group
(or a first or failed IPC transfer) bringing an init and the rest none. Needs neither vLLM nor a
GPU: the receivers' in-worker halves build no tensors, and the dicts are what vLLM 0.32's
``NCCLWeightTransferEngine``, ``IPCWeightTransferEngine`` and flowrl's ``flowrl_gloo`` engine
parse (``transfer.py``'s ``GlooInitInfo`` / ``GlooUpdateInfo`` for the last)."""

from __future__ import annotations

import anyio
import pytest
import torch

from actors.runtime.transports.ipc import IpcReceiver
from actors.runtime.transports.nccl import PACKED_BUFFER_BYTES, PACKED_BUFFERS, BroadcastReceiver
from actors.runtime.transports.shm import ShmReceiver
from actors.runtime.transports.sources import GroupBroadcast, IpcHandles
from actors.sampler.engines.vllm.receive import GLOO_BACKEND, backend, calls, worker_env
from messages.tensor import TensorMeta
from messages.weights import CudaIpcHandle, TransferGroup, WeightsHeader

TENSORS = [TensorMeta("a.weight", "bfloat16", (4, 2)), TensorMeta("b.bias", "float32", (3,))]
UPDATE = {"names": ["a.weight", "b.bias"], "dtype_names": ["bfloat16", "float32"],
          "shapes": [[4, 2], [3]]}


def test_each_transport_sets_up_its_backend_in_the_workers():
    assert backend(BroadcastReceiver.worker_via, cuda=True) == "nccl"  # vLLM's PyNccl engine
    assert backend(BroadcastReceiver.worker_via, cuda=False) == GLOO_BACKEND
    assert backend(IpcReceiver.worker_via, cuda=True) == "ipc"
    assert backend(ShmReceiver.worker_via, cuda=True) == ""  # the worker loads the file
    assert worker_env(IpcReceiver.worker_via) == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    assert worker_env(BroadcastReceiver.worker_via) == {}


@pytest.mark.parametrize("cuda", [False, True])
def test_a_group_broadcast_joins_each_new_group_once(cuda):
    receiver = BroadcastReceiver("cuda:0" if cuda else "cpu", in_worker=True, ranks=2,
                                 timeout_s=30.0)
    g = TransferGroup(address="10.0.0.1", port=29512, world=3, rank=1, bucket_bytes=1 << 20)
    header = WeightsHeader(version=4, transport=receiver.name, tensors=TENSORS, group=g)

    first = anyio.run(receiver.receive, header, {})
    assert first.via == GroupBroadcast(g, joins=True, packed=cuda, timeout_s=30.0)
    init, update = calls(first)
    joined = {"master_address": "10.0.0.1", "master_port": 29512, "rank_offset": 1,
              "world_size": 3}
    assert init == ({**joined, "packed": True, "packed_buffer_size_bytes": PACKED_BUFFER_BYTES,
                     "packed_num_buffers": PACKED_BUFFERS} if cuda else
                    {**joined, "bucket_bytes": 1 << 20, "timeout_s": 30.0})
    assert update == UPDATE
    first.done(None)
    again = anyio.run(receiver.receive, WeightsHeader(version=5, transport=receiver.name,
                                                      tensors=TENSORS, group=g), {})
    assert calls(again) == (None, UPDATE)  # the workers hold the group
    again.done(RuntimeError("a worker died"))  # the group is gone: the next one joins anew
    assert calls(anyio.run(receiver.receive, header, {}))[0] == (
        {**joined, "packed": True, "packed_buffer_size_bytes": PACKED_BUFFER_BYTES,
         "packed_num_buffers": PACKED_BUFFERS} if cuda else
        {**joined, "bucket_bytes": 1 << 20, "timeout_s": 30.0})


def test_ipc_handles_open_on_the_learners_gpu():
    receiver = IpcReceiver("cpu", in_worker=True)
    handles = [CudaIpcHandle([4, 2], [2, 1], 0, "bfloat16", 1, b"h0", 64, 0, b"r0", 0, b"e0", True),
               CudaIpcHandle([3], [1], 0, "float32", 1, b"h1", 16, 64, b"r1", 8, b"e1", False)]
    header = WeightsHeader(version=2, transport=receiver.name, gpu="GPU-abc", tensors=TENSORS,
                           handles=handles)

    first = anyio.run(receiver.receive, header, {})
    assert first.via == IpcHandles("GPU-abc", handles, first=True)
    init, update = calls(first)
    assert init == {"packed": False}
    assert {k: v for k, v in update.items() if k != "ipc_handles"} == UPDATE
    opened = update["ipc_handles"]  # one {learner GPU UUID: rebuild arguments} per tensor
    assert [list(h) for h in opened] == [["GPU-abc"], ["GPU-abc"]]
    args = opened[0]["GPU-abc"]  # torch's rebuild_cuda_tensor arguments, on the handle's GPU
    assert args[:7] == (torch.Tensor, torch.Size([4, 2]), (2, 1), 0, torch.UntypedStorage,
                        torch.bfloat16, 1)
    assert args[7:] == (b"h0", 64, 0, False, b"r0", 0, b"e0", True)
    first.done(None)
    assert calls(anyio.run(receiver.receive, header, {}))[0] is None
