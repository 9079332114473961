"""``ipc``: CUDA IPC on one host (needs a GPU: there is no CPU stand-in for CUDA IPC handles).

The learner gathers a version on its GPU (``Policy.snapshot(dtype, device)``) and sends, per
tensor, the CUDA IPC handle torch's own ``reduce_tensor`` makes (msgspec ``CudaIpcHandle``: the
arguments of ``rebuild_cuda_tensor`` without the two classes, always a plain tensor and an
untyped storage). The sampler opens them on its device, which must be the same physical GPU as
the learner's or one it can peer-map: the hf engine copies the tensors into its model
(device to device, no host copy); the vllm engine hands them to vLLM's
``IPCWeightTransferEngine`` in its worker (``WorkerTransfer``), which loads them through the
layerwise reload. The learner keeps the newest version's tensors alive; torch's IPC reference
counting keeps an older one's memory until every receiver has let its tensors go.

vLLM's worker takes the handles as ``ipc_handles`` (torch's rebuild arguments, as objects):
flowrl pickles nothing; vLLM's own call from the sampler to its engine process serializes them
(its msgpack with a pickle fallback for torch types, allowed by
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in that process only). flowrl's sockets carry the
msgspec handles above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from actors.runtime.devices import indexed
from actors.runtime.tensors import _TORCH, meta
from actors.runtime.transports.base import ReceiveInto, Receiver, Sender
from actors.runtime.transports.sources import IpcHandles, WeightsSource, WorkerTransfer
from messages.codec import encode
from messages.weights import AdapterSpec, CudaIpcHandle, WeightsHeader

if TYPE_CHECKING:
    from actors.runtime.config import LearnerConfig


def share(t: torch.Tensor) -> CudaIpcHandle:
    """``t``'s CUDA IPC handle (torch's ``reduce_tensor``), as a message field."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (_, size, stride, offset, _, dtype, device, handle, storage_bytes, storage_offset_bytes,
     _, ref_handle, ref_offset, event_handle, event_sync) = args
    return CudaIpcHandle(list(size), list(stride), offset, str(dtype).removeprefix("torch."),
                         device, handle, storage_bytes, storage_offset_bytes, ref_handle,
                         ref_offset, event_handle, event_sync)


def rebuild_args(h: CudaIpcHandle, device: int) -> tuple[Any, ...]:
    """``rebuild_cuda_tensor``'s arguments for ``h``, opened on the local ``device``."""
    return (torch.Tensor, torch.Size(h.size), tuple(h.stride), h.offset, torch.UntypedStorage,
            _TORCH[h.dtype], device, h.handle, h.storage_bytes, h.storage_offset_bytes, False,
            h.ref_counter_handle, h.ref_counter_offset, h.event_handle, h.event_sync_required)


class IpcSender(Sender):
    name = "ipc"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = indexed(device)
        self.tensors: list[tuple[str, torch.Tensor]] = []  # the newest version, kept alive

    @classmethod
    def build(cls, learner: LearnerConfig, device: torch.device) -> IpcSender:
        return cls(device)

    async def prepare(self, version: int, tensors: list[tuple[str, torch.Tensor]], *,
                      bucket_bytes: int = 0, adapter: AdapterSpec | None = None
                      ) -> list[list]:
        if any(t.device.type != "cuda" for _, t in tensors):
            raise ValueError("the ipc transport shares CUDA tensors: the learner must gather "
                             "its weights on its GPU (learner.device = cuda)")
        self.tensors = [(n, t.contiguous()) for n, t in tensors]
        index = self.tensors[0][1].device.index if self.tensors else 0
        uuid = str(torch.cuda.get_device_properties(index).uuid) if self.tensors else ""
        return [[encode(WeightsHeader(version=version, transport=self.name, gpu=uuid,
                                      tensors=[meta(n, t) for n, t in self.tensors],
                                      handles=[share(t) for _, t in self.tensors],
                                      adapter=adapter))]]

    def close(self) -> None:
        self.tensors = []


class IpcReceiver(Receiver):
    name = "ipc"
    worker_via = IpcHandles

    def __init__(self, device: torch.device | str = "cuda", in_worker: bool = False) -> None:
        self.device = indexed(device)  # where the hf engine's model is
        self.in_worker = in_worker  # the engine's workers open the handles (vLLM)
        self.initialised = False  # vLLM's engine got its init_info

    @classmethod
    def build(cls, into: ReceiveInto) -> IpcReceiver:
        return cls(into.device, into.in_worker)

    async def receive(self, header: WeightsHeader, parts: dict[str, torch.Tensor]
                      ) -> WeightsSource:
        if len(header.handles) != len(header.tensors):
            raise ValueError("ipc weights header: one handle per tensor expected")
        if self.in_worker:
            return self._worker_transfer(header)
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = self.device.index or 0
        return {m.name: rebuild_cuda_tensor(*rebuild_args(h, index))
                for m, h in zip(header.tensors, header.handles, strict=True)}

    def _worker_transfer(self, header: WeightsHeader) -> WorkerTransfer:
        first = not self.initialised
        self.initialised = True

        def done(exc: BaseException | None) -> None:  # (in the sampler's event loop)
            if exc is not None:
                self.initialised = False  # the next transfer initialises again

        return WorkerTransfer(header.tensors, IpcHandles(header.gpu, header.handles, first), done)
