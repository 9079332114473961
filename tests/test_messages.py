"""Every message round-trips; malformed, truncated, oversized and wrong-type frames are rejected."""

import msgspec
import pytest

from messages.codec import Codec, DecodeError, encode
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


def _tensor(dtype="int32", values=(1, 2, 3)):
    import array
    return Tensor(dtype, (len(values),), array.array("i" if dtype == "int32" else "f", values).tobytes())


def _group():
    prompt = Prompt(7, [ChatMessage("system", "s"), ChatMessage("user", "1 + 2")], "arithmetic", "3",
                    {"a": 1, "b": 2})
    sample = Sample(_tensor(), _tensor("float32", (-0.5, -1.0, -2.0)), policy_version=4, text="3",
                    finish_reason="stop", reward=1.0)
    return ScoredGroup(prompt=prompt, prompt_ids=_tensor(), samples=[sample, sample], sampler="sampler-0",
                       generate_seconds=1.5)


CASES = [
    (ToRunner, Ready("sampler-0", 123)),
    (ToRunner, Heartbeat("replay-0", {"issued": 3, "state": "running", "x": 0.5, "ok": True, "n": None})),
    (ToRunner, StepReport(3, {"critic/score/mean": 0.25})),
    (ToRunner, Finished("learner-0", "done")),
    (ToRunner, ErrorReply("bad")),
    (ToActor, Stop("because")),
    (ToReplay, PromptRequest(4, "pid-1")),
    (ToReplay, GroupsDone([_group()])),
    (ToReplay, BatchRequest(step=2, version=2, num_groups=4)),
    (ToReplay, VersionUpdate(3)),
    (FromReplay, PromptBatch([_group().prompt])),
    (FromReplay, TrainBatch(2, [_group()], {"issued": 8})),
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


@pytest.mark.parametrize(("union", "message"), CASES, ids=lambda c: type(c).__name__)
def test_round_trip(union, message):
    assert Codec(union).decode(encode(message)) == message


def test_every_message_type_is_covered():
    covered = {type(m) for _, m in CASES}
    for union in {u for u, _ in CASES}:
        for member in union.__args__ if hasattr(union, "__args__") else (union,):
            assert member in covered, member


def test_tensor_validation():
    _tensor().validate()
    with pytest.raises(ValueError, match="needs 12 bytes"):
        Tensor("int32", (3,), b"\0" * 11).validate()
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        Tensor("complex64", (1,), b"\0" * 8).validate()


@pytest.mark.parametrize(
    "frame",
    [
        b"",  # empty
        b"\xc1",  # never-used msgpack byte
        encode(PromptRequest(4))[:-1],  # truncated
        encode({"type": "NoSuchMessage"}),  # unknown tag
        encode({"type": "PromptRequest", "max_prompts": "four"}),  # wrong field type
        encode({"type": "BatchRequest", "step": 1}),  # missing fields
        encode([1, 2, 3]),  # wrong shape
        encode(Stop("x")),  # a valid message of another socket
        b"\x00" * 64,
    ],
)
def test_bad_frames_are_rejected_and_counted(frame):
    codec = Codec(ToReplay)
    with pytest.raises(DecodeError):
        codec.decode(frame)
    assert codec.rejected == 1
    # the decoder still works after a rejection
    assert codec.decode(encode(VersionUpdate(1))) == VersionUpdate(1)


def test_oversized_frame_is_rejected_before_decoding():
    codec = Codec(ToReplay, max_frame=100)
    with pytest.raises(DecodeError, match="exceeds"):
        codec.decode(encode(GroupsDone([_group()] * 10)))
    assert codec.rejected == 1


def test_error_names_the_bad_field():
    with pytest.raises(DecodeError, match="max_prompts"):
        Codec(ToReplay).decode(encode({"type": "PromptRequest", "max_prompts": "four"}))


def test_messages_import_without_torch():
    import subprocess
    import sys
    code = ("import sys, messages.rollout, messages.reward, messages.control, messages.weights, "
            "messages.codec; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_schema_is_msgspec_only():
    # no pickle anywhere on the wire: encoded frames are msgpack and decode with plain msgspec
    raw = msgspec.msgpack.decode(encode(VersionUpdate(5)))
    assert raw == {"type": "VersionUpdate", "version": 5}
