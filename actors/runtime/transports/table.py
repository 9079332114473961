"""The weights transports, one row each, and ``auto``.

Each transport is one file (``zmq.py``, ``shm.py``, ``nccl.py``, ``ipc.py``: its ``Sender`` and
``Receiver``, ``base.py``'s halves) and one row of ``TRANSPORTS``, which says what the rest of
the system needs to know of it and loads its file only when it is used; each half builds itself
from what it needs (``Sender.build``, ``Receiver.build``) and ``learner.weights_transport =
"auto"`` is resolved by ``resolve_transport`` alone, when the topology loads. The weights
channel does not change with the transport: versions, long polls, the newest version only. This
module is torch-free: the config reads the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    from actors.runtime.transports.base import Receiver, Sender
    from messages.weights import WeightsHeader


class Halves(NamedTuple):  # a transport's two classes, from its own file
    sender: type[Sender]
    receiver: type[Receiver]


def _zmq() -> Halves:  # each imports its file (torch) only when the transport is used
    from actors.runtime.transports.zmq import ZmqReceiver, ZmqSender

    return Halves(ZmqSender, ZmqReceiver)


def _shm() -> Halves:
    from actors.runtime.transports.shm import ShmReceiver, ShmSender

    return Halves(ShmSender, ShmReceiver)


def _nccl() -> Halves:
    from actors.runtime.transports.nccl import BroadcastReceiver, BroadcastSender

    return Halves(BroadcastSender, BroadcastReceiver)


def _ipc() -> Halves:
    from actors.runtime.transports.ipc import IpcReceiver, IpcSender

    return Halves(IpcSender, IpcReceiver)


ANY_GPU = "any"  # wherever the runner places it
SENDERS_GPU = "the learner's"  # exactly the GPU of the learner's rank 0 (CUDA IPC opens its
# memory there: vLLM's IPC engine looks the handles up by its own GPU's UUID)
OTHER_GPUS = "others"  # none of them the learner's rank 0's (NCCL refuses two ranks of one group
# on one GPU), and GPUs on both ends or CPUs on both ends (NCCL there, gloo here)


@dataclass(frozen=True)
class Transport:
    """One row of the table: a transport's name, its file and what it needs. Every engine
    receives every transport: the tensors, a file (a mapping of them) or, for an engine whose
    own workers receive (its row's ``in_worker``), a ``WorkerTransfer``."""

    name: str
    load: Callable[[], Halves]  # its Sender and Receiver (their file imported when called)
    same_host: bool  # every sampler shares the learner's host
    gpu: bool  # the learner gathers on its device: the bytes go from there (GPU to GPU on GPUs)
    cuda_only: bool = False  # moves CUDA tensors: learner and samplers on GPUs
    framed: bool = False  # the tensors follow each header as frames of its message
    shm_versions: int = 0  # versions held in /dev/shm at once (a start checks they fit there)
    receivers: str = ANY_GPU  # where a sampler's GPUs may be, against the learner's rank 0's
    auto_beside: bool = False  # ``auto``'s choice for samplers on the learner's one GPU


TRANSPORTS: dict[str, Transport] = {t.name: t for t in (  # each file's docstring says more
    # the tensors in the weights messages (buckets of zero-copy frames)
    Transport("zmq", _zmq, same_host=False, gpu=False, framed=True),
    # one safetensors file per version in /dev/shm (SHM_KEEP of them, and the one being written)
    Transport("shm", _shm, same_host=True, gpu=False, shm_versions=3),
    # a broadcast group per sampler (NCCL on GPUs, gloo on CPUs)
    Transport("nccl", _nccl, same_host=False, gpu=True, receivers=OTHER_GPUS),
    # CUDA IPC handles of the learner's gathered tensors, on one host
    Transport("ipc", _ipc, same_host=True, gpu=True, cuda_only=True, receivers=SENDERS_GPU,
              auto_beside=True),
)}
if TYPE_CHECKING:
    TransportChoice = str
else:  # the values of learner.weights_transport: decoding refuses others
    TransportChoice = Literal[("auto", *TRANSPORTS)]


def resolve_transport(setting: str, *, weights_address: str, hosts: bool = False,
                      beside: bool = False) -> str:
    """``learner.weights_transport``: a named transport as is; ``auto`` is shm when the weights
    address is ``ipc://`` (every sampler shares the learner's host, and its /dev/shm), or
    ``auto`` without ``[hosts]`` (the runner makes it ``ipc://``), and zmq otherwise. ``beside``
    (every sampler computes on the learner's own GPU, with an engine whose row allows it): the
    row marked ``auto_beside`` on one host (ipc: no copy through the host)."""
    if setting != "auto":
        return setting
    local = weights_address.startswith("ipc://") or (weights_address == "auto" and not hosts)
    if local and beside:
        return next(t.name for t in TRANSPORTS.values() if t.auto_beside)
    return "shm" if local else "zmq"


def arrived_by(header: WeightsHeader) -> str:
    """The transport ``header`` came by: the one it names ("": zmq's frames, or a shm path)."""
    return header.transport or ("shm" if header.path else "zmq")


def transport_problem(name: str, *, engine: str, weights_address: str, learner_device: str,
                      sampler_device: str) -> str | None:
    """Why transport ``name`` cannot carry this job's weights to ``engine``, or None. A config
    check; an ``auto`` address or device is not judged here: it is resolved later."""
    t = TRANSPORTS[name]  # (decoding refused any other)
    if t.same_host and weights_address != "auto" and not weights_address.startswith("ipc://"):
        return (f"{name} needs every sampler on the learner's host: learner.weights_address "
                f"must be ipc:// (it is {weights_address})")
    devices = (learner_device, sampler_device)
    if t.cuda_only and "auto" not in devices and \
            not all(d.startswith("cuda") for d in devices):
        return (f"{name} moves weights GPU to GPU for sampler.engine = {engine}: set "
                f"learner.device and sampler.device to cuda (they are {learner_device} and "
                f"{sampler_device})")
    return None


def placement_problem(name: str, learner: str, learner_gpus: list[str], sampler: str,
                      sampler_gpus: list[str]) -> str | None:
    """Why transport ``name`` cannot carry the weights from the learner's rank 0 (``learner``,
    on ``learner_gpus``; none: the CPU) to ``sampler`` (on ``sampler_gpus``) as the runner placed
    them, or None. A check of the resolved placement, before anything starts."""
    t = TRANSPORTS[name]
    here = f"GPU {','.join(learner_gpus)}" if learner_gpus else "the CPU"
    there = f"GPU {','.join(sampler_gpus)}" if sampler_gpus else "the CPU"
    if t.receivers == SENDERS_GPU and (not learner_gpus or sampler_gpus != learner_gpus):
        return (f"{name} opens the learner's GPU memory where it is: every sampler must be on "
                f"exactly the GPU of the learner's rank 0 ({learner}: {here}), but {sampler} is "
                f"on {there}; set sampler.device to that GPU (cuda:I, I its index among the "
                "runner's GPUs), or use nccl between GPUs")
    if t.receivers == OTHER_GPUS and bool(learner_gpus) != bool(sampler_gpus):
        return (f"{name} needs GPUs on both ends (NCCL) or CPUs on both ends (gloo), but "
                f"{learner} is on {here} and {sampler} on {there}")
    if t.receivers == OTHER_GPUS and set(learner_gpus) & set(sampler_gpus):
        shared = ",".join(sorted(set(learner_gpus) & set(sampler_gpus)))
        return (f"{name}: NCCL refuses two ranks of one group on one GPU, and {sampler} shares "
                f"GPU {shared} with {learner} (the rank that sends): use ipc for a sampler on "
                "the learner's GPU, or give the samplers GPUs of their own")
    return None
