"""How the vLLM engine takes a GPU transfer: its workers receive the bytes through vLLM's
weight-transfer API (``init_weight_transfer_engine``, ``update_weights``), set up as the engine
starts for the way the job's transport sends (``backend``, ``worker_env``) and driven per
version from the transport's ``WorkerTransfer`` (``calls``).

- A broadcast in a transfer group (``GroupBroadcast``, the nccl transport): on CUDA vLLM's own
  ``NCCLWeightTransferEngine`` (PyNccl, the packed protocol the learner's sender then speaks);
  on a CPU flowrl's ``GLOO_BACKEND`` engine in the worker (``transfer.py``), which speaks the
  transport's torch protocol over gloo.
- CUDA IPC handles (``IpcHandles``, the ipc transport): vLLM's ``IPCWeightTransferEngine``,
  which opens them on the worker's GPU. vLLM's RPC to its engine process carries torch's handle
  types by pickle, which it allows only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set in
  that process only (flowrl's own sockets carry msgspec handles).

Torch is imported only for the IPC handles' rebuild arguments; vLLM not at all (the engine
process imports ``transfer.py``).
"""

from __future__ import annotations

from typing import Any

from actors.runtime.transports.nccl import PACKED_BUFFER_BYTES, PACKED_BUFFERS
from actors.runtime.transports.sources import GroupBroadcast, IpcHandles, WorkerTransfer

GLOO_BACKEND = "flowrl_gloo"  # the weight-transfer backend of ``transfer.py`` (a CPU's workers)
NCCL_BACKEND = "nccl"  # vLLM's NCCLWeightTransferEngine (PyNccl, CUDA)
IPC_BACKEND = "ipc"  # vLLM's IPCWeightTransferEngine


def backend(via: type | None, cuda: bool) -> str:
    """vLLM's weight-transfer backend for transfers that come ``via`` (a receiver's
    ``worker_via``; ``cuda``: the workers are on GPUs); "": none, the engine is handed files or
    tensors."""
    if via is GroupBroadcast:
        return NCCL_BACKEND if cuda else GLOO_BACKEND
    if via is IpcHandles:
        return IPC_BACKEND
    return ""


def worker_env(via: type | None) -> dict[str, str]:
    """What vLLM's engine process needs in its environment to receive transfers ``via``."""
    return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if via is IpcHandles else {}


def calls(transfer: WorkerTransfer) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """``init_weight_transfer_engine``'s init_info (None: the workers hold what they need) and
    ``update_weights``' update_info for ``transfer``."""
    update: dict[str, Any] = {"names": [m.name for m in transfer.tensors],
                              "dtype_names": [m.dtype for m in transfer.tensors],
                              "shapes": [list(m.shape) for m in transfer.tensors]}
    init: dict[str, Any] | None = None
    match transfer.via:
        case GroupBroadcast(group=g, joins=joins, packed=packed, timeout_s=timeout_s):
            if joins:  # a new group: the workers join it from rank_offset g.rank
                init = {"master_address": g.address, "master_port": g.port,
                        "rank_offset": g.rank, "world_size": g.world}
                if packed:
                    init.update(packed=True, packed_buffer_size_bytes=PACKED_BUFFER_BYTES,
                                packed_num_buffers=PACKED_BUFFERS)
                else:
                    init.update(bucket_bytes=g.bucket_bytes, timeout_s=timeout_s)
        case IpcHandles(gpu=gpu, handles=handles, first=first):
            from actors.runtime.transports.ipc import rebuild_args

            init = {"packed": False} if first else None
            update["ipc_handles"] = [{gpu: rebuild_args(h, h.device)} for h in handles]
    return init, update
