"""Every message round-trips; malformed, truncated, oversized and wrong-type frames are rejected."""

import msgspec
import pytest

from messages.codec import Codec, DecodeError, encode
from messages.control import Stop
from messages.rollout import GroupsDone, PromptRequest, ToReplay, VersionUpdate
from messages.tensor import Tensor
from tests.helpers import CASES, sample_group, sample_tensor


@pytest.mark.parametrize(("union", "message"), CASES, ids=lambda c: type(c).__name__)
def test_round_trip(union, message):
    assert Codec(union).decode(encode(message)) == message


def test_every_message_type_is_covered():
    covered = {type(m) for _, m in CASES}
    for union in {u for u, _ in CASES}:
        for member in union.__args__ if hasattr(union, "__args__") else (union,):
            assert member in covered, member


def test_tensor_validation():
    sample_tensor().validate()
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
        codec.decode(encode(GroupsDone([sample_group()] * 10)))
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
