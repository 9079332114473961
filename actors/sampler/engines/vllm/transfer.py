"""The nccl transport's receiver inside a vLLM worker on a CPU: a weight-transfer engine of
vLLM's own kind (``WeightTransferEngine``, registered as ``flowrl_gloo``) that receives over the
same torch.distributed group as the hf engine's receiver (``nccl.TorchGroup``, gloo here).

vLLM's ``NCCLWeightTransferEngine`` runs on PyNccl, CUDA only; this engine lets the vllm
sampler's whole receive path run on a CPU through vLLM's own API (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``: the layerwise reload in
the running worker), so that control flow is tested here; on GPUs the sampler uses vLLM's NCCL
engine instead. Imported in vLLM's engine process: ``FlowrlTransferWorkerExtension`` is the
worker extension the vllm engine names when it receives this way, and importing this module
registers the engine before the worker builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from actors.runtime.tensors import _TORCH
from actors.runtime.transports.nccl import TorchGroup, buckets_of
from actors.sampler.engines.vllm.receive import GLOO_BACKEND
from actors.sampler.engines.vllm.worker import FlowrlWorkerExtension
from messages.tensor import TensorMeta
from messages.weights import TransferGroup


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int = 0
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Receives the learner's bucketed broadcast (``nccl.BroadcastSender``, torch protocol)
    straight into the running model, under vLLM's layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.group: TorchGroup | None = None
        self.bucket_bytes = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        g = TransferGroup(address=init_info.master_address, port=init_info.master_port,
                          world=init_info.world_size, rank=init_info.rank_offset,
                          bucket_bytes=init_info.bucket_bytes)
        self.bucket_bytes = init_info.bucket_bytes
        self.group = TorchGroup(g, init_info.rank_offset + self.parallel_config.rank,
                                torch.device("cpu"), init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # no accelerator to sync

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("flowrl_gloo weight transfer used before init_weight_transfer_engine")
        metas = [TensorMeta(n, d, tuple(s)) for n, d, s in
                 zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True)]
        try:
            for bucket in buckets_of(metas, self.bucket_bytes):
                flat = torch.empty(sum(m.nbytes() for m in bucket), dtype=torch.uint8)
                self.group.broadcast(flat)
                weights, offset = [], 0
                for m in bucket:
                    n = m.nbytes()
                    weights.append((m.name, flat[offset:offset + n].view(_TORCH[m.dtype])
                                    .view(m.shape)))
                    offset += n
                self.model.load_weights(weights)
            self.group.all_have(True, torch.device("cpu"))
        except BaseException:
            self.shutdown()  # the learner sees the group go and forms a new one
            raise

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


if GLOO_BACKEND not in WeightTransferEngineFactory._registry:  # registered once per process
    WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)


class FlowrlTransferWorkerExtension(FlowrlWorkerExtension):
    """flowrl's worker extension with the ``flowrl_gloo`` engine registered in this process
    (the vllm engine names it whenever its worker receives weight transfers)."""

    def flowrl_redispatch_head(self) -> bool:
        """After a transfer: the CPU's tied ``lm_head`` re-packed from the new embedding, as
        after a file load (a no-op on GPUs)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        self._flowrl_redispatch_tied_head(runner.get_model(), runner)
        return True
