"""Shared by the tests: one valid message of every type, a pickle detector for the frames, and
actors run in-process on ipc sockets (whole jobs through ``runner.py``: ``tests/jobs.py``)."""

from __future__ import annotations

import array
import pickletools
import tempfile
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import zmq

from actors.job.config.load import apply_overrides, decode_topology
from actors.runtime.actor import ActorContext
from actors.runtime.config import Topology
from actors.sandbox.protocol import Call, FunctionSpec, Outcome, Outcomes, Setup
from actors.sandbox.protocol import Ready as ChildReady
from messages.codec import encode
from messages.control import (
    Abort,
    AskTopology,
    ErrorReply,
    Finished,
    Heartbeat,
    ImageSample,
    JobTopology,
    Ready,
    StepReport,
    Stop,
    ToActor,
    ToAttacher,
    ToRunner,
    ValidationReport,
)
from messages.learner_ranks import RanksEnd, RanksPublish, RanksSave, RanksStep, ToLearnerRanks
from messages.reward import (
    Response,
    ScoreReply,
    ScoreRequest,
    ScoreResult,
    ToRewardWorker,
    ToScoringClient,
)
from messages.rollout import (
    BatchRequest,
    ChatMessage,
    FromReplay,
    GroupsDone,
    LeaveAck,
    Prompt,
    PromptBatch,
    PromptRequest,
    PublishReady,
    PublishRequest,
    Sample,
    SamplerAlive,
    SamplerLeaving,
    SamplingParams,
    ScoredGroup,
    ToReplay,
    TrainBatch,
    Turn,
    ValidationDone,
    VersionUpdate,
)
from messages.routing import (
    Envelope,
    RouterError,
    ToClient,
    ToRouterFromClient,
    ToRouterFromWorker,
    ToWorker,
    WorkerBye,
    WorkerHeartbeat,
    WorkerHello,
)
from messages.teacher import TeacherReply, TeacherRequest, ToTeacherClient, ToTeacherWorker
from messages.tensor import Tensor, TensorMeta
from messages.weights import (
    AdapterSpec,
    CudaIpcHandle,
    FromLearnerWeights,
    ToLearnerWeights,
    TransferGroup,
    WeightsHeader,
    WeightsPoll,
)

# ---------------------------------------------------------------- messages


def sample_tensor(dtype="int32", values=(1, 2, 3)):
    codes = {"int32": "i", "float32": "f", "int8": "b"}
    return Tensor(dtype, (len(values),), array.array(codes[dtype], values).tobytes())


def sample_group():
    prompt = Prompt(7, [ChatMessage("system", "s"), ChatMessage("user", "1 + 2")], "arithmetic", "3",
                    {"a": 1, "b": 2})
    sample = Sample(sample_tensor(), sample_tensor("float32", (-0.5, -1.0, -2.0)), policy_version=4, text="3",
                    finish_reason="stop", reward=1.0, token_versions=sample_tensor("int32", (4, 4, 4)),
                    loss_mask=sample_tensor("int8", (1, 1, 1)))
    return ScoredGroup(prompt=prompt, prompt_ids=sample_tensor(), samples=[sample, sample], sampler="sampler-0",
                       generate_seconds=1.5,
                       sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_tokens=16,
                                               stop=("\n\n",)))


def distilled_group() -> ScoredGroup:
    """``sample_group`` with the teacher's log-probs on each sample (on-policy distillation)."""
    g = sample_group()
    teacher = sample_tensor("float32", (-0.25, -3.0, -0.5))
    return msgspec.structs.replace(g, samples=[msgspec.structs.replace(s, teacher_logprobs=teacher)
                                               for s in g.samples], teacher_seconds=0.25)


def multi_turn_group() -> ScoredGroup:
    """A group whose sample called a tool: a model turn, the tool's answer (loss mask 0), and
    the model's last turn."""
    turns = [Turn("assistant", 0, 2, "<tool_call>"), Turn("tool", 2, 4, "3", name="calculator",
                                                          arguments='{"expression": "1+2"}',
                                                          latency_s=0.01),
             Turn("assistant", 4, 5, "3")]
    sample = Sample(sample_tensor(values=(1, 2, 3, 4, 5)),
                    sample_tensor("float32", (-0.5, -1.0, 0.0, 0.0, -0.1)), policy_version=4,
                    text="<tool_call>3 3", finish_reason="stop", reward=1.0,
                    token_versions=sample_tensor("int32", (4, 4, 4, 4, 5)),
                    loss_mask=sample_tensor("int8", (1, 1, 0, 0, 1)), turns=turns)
    return msgspec.structs.replace(sample_group(), samples=[sample])


def score_request(*solutions: str, data_source: str = "arithmetic", ground_truth: str = "3",
                  **fields) -> ScoreRequest:
    """One group's request: the prompt's fields once, one ``Response`` per solution."""
    return ScoreRequest(data_source, ground_truth, [Response(s, len(s)) for s in solutions],
                        **fields)


def routed(request_id: int, body, pool: str = "reward") -> list[bytes]:
    """The two frames of a routed request: its envelope, then the encoded body."""
    return [encode(Envelope(request_id, pool)), body if isinstance(body, bytes) else encode(body)]


ToChild = Setup | Call  # the sandbox pipe (length-framed msgpack between a worker and its children)
FromChild = ChildReady | Outcomes

# (union, message): one valid message of every type of every union that crosses a process boundary
CASES = [
    (ToRunner, Ready("sampler-0", 123)),
    (ToRunner, Ready("learner-0", 124, {"state": "running", "resumed_from": "step_30"})),
    (ToRunner, Heartbeat("replay-0", {"issued": 3, "state": "running", "x": 0.5, "ok": True, "n": None,
                                      "reward-0": {"pool": "reward", "done": 4, "p50_ms": 1.5,
                                                   "leaving": False}})),
    (ToRunner, StepReport(3, {"critic/score/mean": 0.25})),
    (ToRunner, StepReport(10, {"critic/score/mean": 0.5},
                          [ImageSample([b"\x89PNG\r\n"], "red", 1.0, 7)])),
    (ToRunner, Finished("learner-0", "done")),
    (ToRunner, Finished("learner-0", "done", {"state": "finished", "step": 32})),
    (ToRunner, ErrorReply("bad")),
    (ToRunner, ValidationReport(10, {"val-core/arithmetic/reward/mean@4": 0.5})),
    (ToRunner, Abort("replay-0", "scoring failed on 32 of 32 samples\nfirst failure: ...")),
    (ToRunner, AskTopology()),
    (ToAttacher, JobTopology(b'{"run": {}}')),
    (ToActor, Stop("because")),
    (ToReplay, PromptRequest(4, "pid-1")),
    (ToReplay, GroupsDone([sample_group()])),
    (ToReplay, GroupsDone([multi_turn_group()])),
    (ToReplay, BatchRequest(step=2, version=2, num_groups=4)),
    (ToReplay, VersionUpdate(3)),
    (ToReplay, SamplerAlive("1234-5678")),
    (ToReplay, SamplerLeaving("1234-5678", [3, 7])),
    (ToReplay, ValidationDone(10, [sample_group()])),
    (ToReplay, PublishRequest(3)),
    (FromReplay, PromptBatch([sample_group().prompt], version=2)),
    (FromReplay, PromptBatch([sample_group().prompt], version=10, validation=True,
                             sampling=SamplingParams(temperature=0.6, max_tokens=16), n=4)),
    (FromReplay, LeaveAck(2)),
    (FromReplay, PublishReady(3)),
    (FromReplay, PromptBatch([sample_group().prompt], version=1, seed=12345)),
    (FromReplay, TrainBatch(2, [sample_group()], {"issued": 8}, {"age/mean": 0.5})),
    (ToRouterFromClient, Envelope(1, "reward")),
    (ToRouterFromWorker, Envelope(1)),
    (ToRouterFromWorker, WorkerHello("reward-0", "reward", 4)),
    (ToRouterFromWorker, WorkerHeartbeat("reward-0")),
    (ToRouterFromWorker, WorkerBye("reward-0")),
    (ToWorker, Envelope(3, "reward")),
    (ToWorker, RouterError("x", 3)),
    (ToWorker, WorkerBye("reward-0")),
    (ToClient, Envelope(1)),
    (ToClient, RouterError("y")),
    (ToRewardWorker, score_request("1 + 2 = 3", "4", extra_info={"a": 1, "b": 2},
                                   prompt=[ChatMessage("user", "1 + 2")], max_response_length=32)),
    (ToRewardWorker, ScoreRequest("calculator", "3", [Response(
        "<tool_call>3 3", 5, multi_turn_group().samples[0].turns)])),
    (ToScoringClient, ScoreReply([ScoreResult(1.0), ScoreResult(0.0, error="boom", extra={"k": 1.0}),
                                  ScoreResult(1.0, answer="42")])),
    (ToReplay, GroupsDone([distilled_group()])),
    (ToTeacherWorker, TeacherRequest(sample_tensor(), [sample_tensor(), sample_tensor("int32", (5,))])),
    (ToTeacherClient, TeacherReply([sample_tensor("float32", (-0.5, -1.0, -2.0))])),
    (ToTeacherClient, TeacherReply([], error="teacher: RuntimeError: out of memory")),
    (ToLearnerWeights, WeightsPoll(-1)),
    (ToLearnerRanks, RanksStep([sample_group()])),
    (ToLearnerRanks, RanksPublish("bfloat16")),
    (ToLearnerRanks, RanksSave()),
    (ToLearnerRanks, RanksEnd()),
    (FromLearnerWeights, WeightsHeader(2, [TensorMeta("w", "float32", (2, 3))])),
    (FromLearnerWeights, WeightsHeader(3, [TensorMeta("w", "bfloat16", (2, 3))], transport="nccl",
                                       group=TransferGroup("127.0.0.1", 29500, 2, bucket_bytes=64))),
    (FromLearnerWeights, WeightsHeader(4, [TensorMeta("w", "bfloat16", (2, 3))], transport="ipc",
                                       handles=[CudaIpcHandle([2, 3], [3, 1], 0, "bfloat16", 0,
                                                              b"h", 12, 0, b"r", 0, b"e", True)],
                                       gpu="GPU-0")),
    (FromLearnerWeights, WeightsHeader(5, [TensorMeta("m.q_proj.lora_A.weight", "float32", (8, 64))],
                                       adapter=AdapterSpec(8, 16.0, ["q_proj", "v_proj"]))),
    (ToChild, Setup([FunctionSpec(module="actors.scoring.rules", name="math",
                                  preload=("math_verify.parser",)),
                     FunctionSpec(path="/x/my_reward.py", batch=True, kwargs={"bonus": 0.5})],
                    memory_mb=256, cpu_s=1)),
    (ToChild, Call(0, [{"data_source": "d", "solution_str": "s", "ground_truth": "g",
                        "extra_info": {"k": 1}}], 1)),
    (FromChild, ChildReady(["", "SyntaxError: x"])),
    (FromChild, Outcomes([Outcome(1.0), Outcome(error="e"), Outcome(0.5, extra={"a": 1.0}),
                          Outcome(text="42"), Outcome(error="timed out", failure="timeout"),
                          Outcome(1.0, answer="7")])),
]


def union_members(union) -> tuple[type, ...]:
    return union.__args__ if hasattr(union, "__args__") else (union,)


# ---------------------------------------------------------------- actors in this process


def live_topology(sockets: str, *overrides: str) -> Topology:
    """A topology whose every address is an ipc socket in ``sockets``, with fast heartbeats."""
    return decode_topology(apply_overrides({}, [
        f"replay.address=ipc://{sockets}/replay", f"router.address=ipc://{sockets}/router",
        f"router.worker_address=ipc://{sockets}/workers",
        f"learner.weights_address=ipc://{sockets}/weights", f"control_address=ipc://{sockets}/control",
        "run.heartbeat_interval=0.2", "sampler.engine=hf", *overrides]))


def actor_context(kind: str, topo: Topology, zctx: zmq.Context, run_dir: Path | None = None
                  ) -> ActorContext:
    """The context of actor ``kind``-0 for ``serve_actor`` without a runner."""
    return ActorContext(kind=kind, index=0, topology=topo,
                        run_dir=run_dir or Path(tempfile.mkdtemp()), zmq=zctx)


async def wait_for(what: str, ready: Callable[[], bool], limit_s: float = 5.0) -> None:
    """Poll a value an actor publishes on a timer (its status dict) until ``ready()``; fail
    naming ``what`` after ``limit_s`` seconds."""
    try:
        with anyio.fail_after(limit_s):
            while not ready():  # noqa: ASYNC110 - a plain dict, refreshed on the actor's timer
                await anyio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {limit_s:g} s") from None


# ---------------------------------------------------------------- the wire carries no pickle


def is_pickle(frame: bytes) -> bool:
    """Whether ``frame`` is a whole pickle stream (any protocol): its opcodes parse and it ends
    with STOP exactly at its last byte. Nothing is unpickled."""
    try:
        ops = list(pickletools.genops(frame))
    except Exception:  # noqa: BLE001 - genops raises ValueError, IndexError, ... on non-pickles
        return False
    return bool(ops) and ops[-1][0].name == "STOP" and ops[-1][2] == len(frame) - 1


def byte_leaves(value) -> list[bytes]:
    """Every bytes value inside a schema-less decoded message (tensor data and the like)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return [bytes(value)]
    if isinstance(value, dict):
        return [b for v in (*value.keys(), *value.values()) for b in byte_leaves(v)]
    if isinstance(value, list | tuple):
        return [b for v in value for b in byte_leaves(v)]
    return []


def child_pids(children) -> list[int]:
    """The pids of a ``Children``'s live children (its own table: the product has no use for
    them)."""
    return list(children._alive)
