"""The learner's ranks as one torch.distributed group, and FSDP2 over them.

``Group`` is what the policy and the trainer see of the other ranks: a lone rank (no process
group at all: the 1-rank CPU learner is the plain model it always was) or a torch.distributed
group (gloo on CPU, NCCL on GPU) whose ranks run the same code on the same inputs. Every method
is a collective: every rank calls it, in the same order. Between ranks only tensors travel, and
bytes as a uint8 tensor (length first), msgspec-encoded by the caller: no pickle, so no
``broadcast_object_list``.

Sharding (``shard``): ``fully_shard`` on each decoder layer (the model's ``_no_split_modules``)
and on the root, so each layer's parameters are all-gathered for its forward and backward and
freed after, and gradients are reduce-scattered as summed (not averaged) values: the trainer
divides every loss by the global token or sequence count, so the sum over ranks is the gradient
of one rank holding the whole batch. A ``MixedPrecisionPolicy(param_dtype=compute,
reduce_dtype=float32)`` keeps master parameters and optimizer state in ``model.dtype``.
Ranks other than 0 build their models on the meta device and receive rank 0's weights while
sharding (``load``), so a node holds one full copy of the model in host memory, not one per rank.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from actors.runtime.ranks import Rank

# How long a follower waits for rank 0's next control message: no bound in practice. Rank 0 may
# legitimately take hours between two (a long validation, a slow checkpoint), and a rank that
# dies is not waited for here: the runner stops every rank of the group when any one exits.
CONTROL_TIMEOUT = datetime.timedelta(days=30)


def backend_for(device: torch.device, offload: bool) -> str:
    """The process group's backend: gloo on a CPU; NCCL on GPUs, with gloo beside it for CPU
    tensors when FSDP2 offloads (``CPUOffloadPolicy`` keeps the shards in host memory, so the
    weights' all-gather, gradient clipping and the state dict run collectives on CPU tensors,
    which an NCCL-only group refuses: "No backend type associated with device type cpu")."""
    if device.type != "cuda":
        return dist.Backend.GLOO
    nccl = dist.Backend.NCCL
    return f"cpu:{dist.Backend.GLOO},cuda:{nccl}" if offload else nccl


class Group:
    """This process's view of the learner's ranks (``rank 0`` leads: it alone has a batch to
    broadcast, a step to report, weights to send)."""

    def __init__(self, rank: Rank, device: torch.device, *, distributed: bool) -> None:
        self.rank = rank.rank
        self.world = rank.world_size
        self.device = device  # where this rank computes, and where its collectives' tensors live
        self.distributed = distributed  # a process group exists (world > 1, or FSDP on one rank)
        self.mesh = None
        self.control = None  # the side group control messages travel on (several ranks)
        if distributed:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device.type, (self.world,))
            if self.world > 1:  # every rank creates it, in the same order
                self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def lone(cls, device: torch.device | None = None) -> Group:
        """One rank and no process group: the plain model on one device."""
        return cls(Rank.from_env({}), device or torch.device("cpu"), distributed=False)

    @classmethod
    def join(cls, rank: Rank, device: torch.device, *, timeout_s: float = 600.0,
             offload: bool = False) -> Group:
        """Join the group; returns once every rank has (the rendezvous at rank 0's store).

        A single rank gets a process group of its own (a local store) so FSDP2 can hold its
        mixed precision; several rendezvous at ``MASTER_ADDR:MASTER_PORT``."""
        backend = backend_for(device, offload)
        timeout = datetime.timedelta(seconds=timeout_s)
        extra = {"device_id": device} if device.type == "cuda" else {}
        if rank.world_size == 1:
            if not dist.is_initialized():  # a second learner in one process (tests) shares it
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                        timeout=timeout, **extra)
        else:
            dist.init_process_group(
                backend, init_method=f"tcp://{rank.master_addr}:{rank.master_port}",
                rank=rank.rank, world_size=rank.world_size, timeout=timeout, **extra)
        return cls(rank, device, distributed=True)

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    # -- collectives (no-ops for a lone rank) ---------------------------------------------------

    def broadcast_control(self, data: bytes | None) -> bytes:
        """Rank 0's control message on every rank (others pass None and wait for it, however
        long rank 0 takes: ``CONTROL_TIMEOUT``). Travels on the gloo side group as CPU tensors,
        never on NCCL, whose watchdog would kill a follower waiting past
        ``learner.collective_timeout_s`` while rank 0 starts a vLLM sampler, waits for a long
        first batch or writes a big checkpoint."""
        if self.control is None:
            assert data is not None
            return data
        return _broadcast_bytes(data if self.leader else None, self.leader,
                                torch.device("cpu"), self.control)


    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (rows each rank filled alone, zeros
        elsewhere, become the whole batch's)."""
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def sum_floats(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (float64)."""
        if self.world == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any: one decision all ranks act on."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def _broadcast_bytes(data: bytes | None, leader: bool, device: torch.device, group) -> bytes:
    size = torch.tensor([len(data) if leader and data is not None else 0],
                        dtype=torch.int64, device=device)
    dist.broadcast(size, 0, group=group)
    n = int(size.item())
    if n == 0:
        return b""
    if leader:
        assert data is not None
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buf, 0, group=group)
    return data if leader and data is not None else buf.cpu().numpy().tobytes()


# -- models over the group ------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one by one: modules of the classes a Hugging Face model lists in
    ``_no_split_modules`` (its decoder layer)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def mixed_precision(compute: torch.dtype, params: torch.dtype):
    """FSDP2's policy: compute in ``compute``, reduce gradients in float32, keep the master
    parameters in ``params`` (None when they are the same: no casts at all)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute == params:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def shard(model: nn.Module, group: Group, compute: torch.dtype, params: torch.dtype,
          keep: bool = False, offload: bool = False) -> None:
    """``fully_shard`` each decoder layer, then the root; gradients summed over ranks. ``keep``:
    gathered parameters stay gathered from forward to backward (``keep_gathered``). ``offload``:
    the shards, their gradients and so the optimizer state live in host memory
    (``CPUOffloadPolicy``; pinned when the device is a GPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

    mp = mixed_precision(compute, params)
    policy = (CPUOffloadPolicy(pin_memory=group.device.type == "cuda") if offload
              else OffloadPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=group.mesh, mp_policy=mp, reshard_after_forward=not keep,
                    offload_policy=policy)
    fully_shard(model, mesh=group.mesh, mp_policy=mp, reshard_after_forward=not keep,
                offload_policy=policy)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # the losses are already global means
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM


def keep_gathered(setting: bool | None, device: torch.device) -> bool:
    """``learner.reshard_after_forward`` negated, by default by device: on a CPU gathered
    parameters stay gathered from forward to backward, and gradients accumulate whole over a
    mini-batch's micro-batches before one reduce-scatter (host memory is plentiful there, and
    every copy the collectives make costs the cores that compute: BENCHMARKS.md, "The
    learner"); on a GPU both are given back as soon as possible."""
    return device.type == "cpu" if setting is None else not setting


def sync_gradients(module: nn.Module | None, last: bool) -> None:
    """Before a backward pass of a module kept gathered: reduce its gradients after it only when
    it is the last micro-batch of the mini-batch."""
    if module is not None and is_sharded(module):
        module.set_requires_gradient_sync(last)


def load(group: Group, full: Callable[[], nn.Module], empty: Callable[[], nn.Module], *,
         compute: torch.dtype, params: torch.dtype, keep: bool = False,
         offload: bool = False) -> nn.Module:
    """A model on the group's device: ``full()`` builds it with its weights (on the CPU), and
    ``empty()`` builds the same architecture without them (called under the meta device).

    A lone rank: ``full()`` moved to the device. A group: rank 0 builds ``full()``, the others
    ``empty()``, every rank shards, and rank 0's weights and buffers reach the others' shards."""
    if not group.distributed:
        return full().to(group.device)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if group.leader:
        model = full()
        state = dict(model.state_dict())  # the full tensors, alive until every shard has them
    else:
        with torch.device("meta"):
            model = empty()
        state = {}
    shard(model, group, compute, params, keep, offload)  # rank 0's shards to the device (or host)
    if group.world > 1:
        if not group.leader:
            model.to_empty(device=group.device)
        set_model_state_dict(model, state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        for buf in model.buffers():  # non-persistent ones (rotary frequencies) too
            dist.broadcast(buf, 0)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unwrapped_class(model: nn.Module) -> type:
    """The model's own class under FSDP's ``FSDP<Class>`` wrapper class."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def full_parameters(model: nn.Module, group: Group, dtype: torch.dtype | None = None
                    ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Every parameter (tied ones once) whole, in ``dtype`` (None: as stored), gathered layer by
    layer on the group's device: each rank casts its own shards to ``dtype`` first (a bf16
    sampler's gather moves half an fp32 one's bytes), and one layer's parameters travel in one
    all-gather. Rank 0 gets each tensor on the device (copy or send it before the next layer),
    the others None. A device holds one layer whole beyond its shards, never the model."""
    from torch.distributed.tensor import DTensor

    for layer in _layers(model.named_parameters()):
        sharded = [p for _, p in layer if isinstance(p, DTensor)]
        whole = iter(_gather_layer(sharded, dtype) if sharded else [])
        for name, p in layer:
            value = next(whole) if isinstance(p, DTensor) else p.detach().to(dtype or p.dtype)
            yield name, value if group.leader else None


def _layers(named: Iterator[tuple[str, nn.Parameter]]) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """Consecutive parameters of one decoder layer (names keyed on their first integer segment,
    ``model.layers.3.``) together; every other parameter alone."""
    layer: list[tuple[str, nn.Parameter]] = []
    key = None
    for name, p in named:
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        this = ".".join(parts[:index + 1]) if index is not None else None
        if layer and (this is None or this != key):
            yield layer
            layer = []
        layer.append((name, p))
        key = this
    if layer:
        yield layer


def _gather_layer(params: list, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """The whole tensors of FSDP2-sharded ``params`` (dim-0 shards, ``torch.chunk`` sizes: rank r
    holds rows ``r·c .. (r+1)·c`` of ``c = ceil(rows / world)``) in one all-gather: every rank
    lays out its shards cast to ``dtype``, each padded to ``c`` rows, side by side."""
    from torch.distributed.tensor import Shard

    mesh = params[0].device_mesh
    world = mesh.size()
    dtype = dtype or params[0].dtype
    if any(p.placements != (Shard(0),) or p.dtype != params[0].dtype for p in params):
        return [p.full_tensor().to(dtype) for p in params]  # not FSDP's layout: one by one
    sizes, parts = [], []
    for p in params:
        rows = p.shape[0]
        per = -(-rows // world)  # rows of a full shard
        inner = math.prod(p.shape[1:])
        local = p.to_local().detach().to(dtype).reshape(-1)  # (local_rows·inner,)
        pad = per * inner - local.numel()
        parts.append(torch.nn.functional.pad(local, (0, pad)) if pad else local)
        sizes.append((per, inner))
    flat = torch.cat(parts)  # (S,) this rank's shards of the layer
    out = torch.empty(world * flat.numel(), dtype=dtype, device=flat.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, flat, group=mesh.get_group())
    table = out.view(world, -1)  # (world, S)
    whole, offset = [], 0
    for p, (per, inner) in zip(params, sizes, strict=True):
        block = table[:, offset:offset + per * inner]  # (world, per·inner)
        whole.append(block.reshape(world * per, *p.shape[1:])[:p.shape[0]])
        offset += per * inner
    return whole


def full_state_dict(model: nn.Module, group: Group) -> dict[str, torch.Tensor]:
    """The whole state dict on rank 0's CPU (empty on the others); a collective when sharded."""
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def save_optimizer(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                   group: Group) -> None:
    """The optimizer state, sharded as it lies (torch.distributed.checkpoint: each rank writes
    its own shards into ``path``, rank 0 the metadata); any number of ranks can load it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer)
    with _single_process(group):
        dcp.save({"optimizer": state}, checkpoint_id=path, no_dist=not group.distributed)


def load_optimizer(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                   group: Group) -> None:
    """Load what ``save_optimizer`` wrote, with this group's number of ranks (resharded)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = get_optimizer_state_dict(model, optimizer)  # the layout to fill (initialises it)
    wrapped = {"optimizer": state}
    with _single_process(group):
        dcp.load(wrapped, checkpoint_id=path, no_dist=not group.distributed)
    set_optimizer_state_dict(model, optimizer, wrapped["optimizer"])


@contextlib.contextmanager
def _single_process(group: Group) -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        if not group.distributed:
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def _lone_shards(params: list[nn.Parameter]) -> bool:
    """FSDP2's DTensor parameters on a mesh of one rank, where each local tensor is the whole
    parameter: the optimizer and the gradient norm can run on them as plain tensors."""
    return bool(params) and all(hasattr(p, "to_local") and p.device_mesh.size() == 1
                                for p in params)


@torch.no_grad()  # (as torch's own: no autograd node per gradient's to_local)
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, the same arithmetic; on one rank's FSDP2 parameters
    over their local tensors (the whole gradients), without DTensor's dispatch on every
    gradient (on a GPU that dispatch costs far more CPU time than the norm's kernels). On
    plain gradients of one device and dtype, without torch's moving each one's norm to the
    first one's device (a ``to`` dispatched per parameter that moves nothing)."""
    if _lone_shards(params):
        grads = [p.grad.to_local() for p in params if p.grad is not None]
    else:
        grads = [p.grad for p in params if p.grad is not None]
        if len({(g.device, g.dtype) for g in grads}) > 1 \
                or any(hasattr(g, "to_local") for g in grads):  # DTensors over several ranks
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
    if not grads:
        return torch.zeros((), device=params[0].device)
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total


@torch.no_grad()
def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()``; on one rank's FSDP2 parameters the step runs on their local
    tensors, with the state's local tensors: the same storage and the same update (AdamW is
    elementwise), without DTensor's dispatch per tensor of the step. The optimizer keeps its
    DTensor parameters and state (checkpoints see them as before); the first step, which
    creates the state, runs on the DTensors."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not _lone_shards(params) or any(p.grad is not None and p not in optimizer.state
                                       for p in params):
        optimizer.step()
        return
    state, groups = optimizer.state, [g["params"] for g in optimizer.param_groups]
    local: dict = {}
    views: list[torch.Tensor] = []
    try:
        for group in optimizer.param_groups:
            group_views = []
            for p in group["params"]:
                view = p.to_local()  # (under no_grad: the parameter's own local tensor)
                view.grad = None if p.grad is None else p.grad.to_local()
                if p in state:
                    local[view] = {k: v.to_local() if hasattr(v, "to_local") else v
                                   for k, v in state[p].items()}
                group_views.append(view)
            views += group_views
            group["params"] = group_views
        optimizer.state = local  # type: ignore[assignment]
        optimizer.step()
    finally:
        optimizer.state = state
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            group["params"] = saved
        for view in views:  # the local tensors persist with their parameters: a gradient left
            view.grad = None  # on one would outlive zero_grad and the next forward and backward
