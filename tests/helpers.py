"""Shared by the tests: one valid message of every type, and actors run in-process on ipc sockets."""

from __future__ import annotations

import tempfile
from pathlib import Path

import zmq

from actors.runtime.actor import ActorContext
from actors.runtime.config import Topology, apply_overrides, decode_topology
from messages.control import (
    ErrorReply,
    Finished,
    Heartbeat,
    Ready,
    StepReport,
    Stop,
    ToActor,
    ToRunner,
)
from messages.reward import (
    RouterError,
    ScoreItem,
    ScoreReply,
    ScoreRequest,
    ScoreResult,
    ToClient,
    ToRouterFromClient,
    ToRouterFromWorker,
    ToWorker,
    WorkerBye,
    WorkerHeartbeat,
    WorkerHello,
)
from messages.rollout import (
    BatchRequest,
    ChatMessage,
    FromReplay,
    GroupsDone,
    Prompt,
    PromptBatch,
    PromptRequest,
    Sample,
    ScoredGroup,
    ToReplay,
    TrainBatch,
    VersionUpdate,
)
from messages.tensor import Tensor
from messages.weights import (
    FromLearnerWeights,
    TensorMeta,
    ToLearnerWeights,
    WeightsHeader,
    WeightsPoll,
)


def sample_tensor(dtype="int32", values=(1, 2, 3)):
    import array
    return Tensor(dtype, (len(values),), array.array("i" if dtype == "int32" else "f", values).tobytes())


def sample_group():
    prompt = Prompt(7, [ChatMessage("system", "s"), ChatMessage("user", "1 + 2")], "arithmetic", "3",
                    {"a": 1, "b": 2})
    sample = Sample(sample_tensor(), sample_tensor("float32", (-0.5, -1.0, -2.0)), policy_version=4, text="3",
                    finish_reason="stop", reward=1.0)
    return ScoredGroup(prompt=prompt, prompt_ids=sample_tensor(), samples=[sample, sample], sampler="sampler-0",
                       generate_seconds=1.5)


CASES = [
    (ToRunner, Ready("sampler-0", 123)),
    (ToRunner, Heartbeat("replay-0", {"issued": 3, "state": "running", "x": 0.5, "ok": True, "n": None})),
    (ToRunner, StepReport(3, {"critic/score/mean": 0.25})),
    (ToRunner, Finished("learner-0", "done")),
    (ToRunner, ErrorReply("bad")),
    (ToActor, Stop("because")),
    (ToReplay, PromptRequest(4, "pid-1")),
    (ToReplay, GroupsDone([sample_group()])),
    (ToReplay, BatchRequest(step=2, version=2, num_groups=4)),
    (ToReplay, VersionUpdate(3)),
    (FromReplay, PromptBatch([sample_group().prompt])),
    (FromReplay, TrainBatch(2, [sample_group()], {"issued": 8})),
    (ToRouterFromClient, ScoreRequest(1, [ScoreItem("arithmetic", "3", "3", {"a": 1})])),
    (ToRouterFromWorker, ScoreReply(1, [ScoreResult(1.0), ScoreResult(0.0, error="boom")])),
    (ToRouterFromWorker, WorkerHello("reward-0", "reward", 4)),
    (ToRouterFromWorker, WorkerHeartbeat("reward-0")),
    (ToRouterFromWorker, WorkerBye("reward-0")),
    (ToWorker, RouterError("x", 3)),
    (ToClient, RouterError("y")),
    (ToLearnerWeights, WeightsPoll(-1)),
    (FromLearnerWeights, WeightsHeader(2, [TensorMeta("w", "float32", (2, 3))])),
]


def live_topology(sockets: str, *overrides: str) -> Topology:
    """A topology whose every address is an ipc socket in ``sockets``, with fast heartbeats."""
    return decode_topology(apply_overrides({}, [
        f"replay.address=ipc://{sockets}/replay", f"router.address=ipc://{sockets}/router",
        f"router.worker_address=ipc://{sockets}/workers",
        f"learner.weights_address=ipc://{sockets}/weights", f"control_address=ipc://{sockets}/control",
        "run.heartbeat_interval=0.2", *overrides]))


def actor_context(kind: str, topo: Topology, zctx: zmq.Context, run_dir: Path | None = None
                  ) -> ActorContext:
    """The context of actor ``kind``-0 for ``serve_actor`` without a runner."""
    return ActorContext(kind=kind, index=0, topology=topo,
                        run_dir=run_dir or Path(tempfile.mkdtemp()), zmq=zctx)
