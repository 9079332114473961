"""Every message round-trips; malformed, truncated, oversized and wrong-type frames are rejected;
no frame is a pickle and every frame is plain msgpack."""

import importlib
import pickle
import pkgutil
import types

import msgspec
import pytest

import messages
from messages.codec import Codec, DecodeError, encode
from messages.control import Stop
from messages.rollout import GroupsDone, PromptRequest, ToReplay, VersionUpdate
from messages.tensor import Tensor
from tests.helpers import (
    CASES,
    byte_leaves,
    is_pickle,
    sample_group,
    sample_tensor,
    union_members,
)

CASE_IDS = [type(m).__name__ for _, m in CASES]


@pytest.mark.parametrize(("union", "message"), CASES, ids=CASE_IDS)
def test_round_trip(union, message):
    assert Codec(union).decode(encode(message)) == message


def _message_modules():
    return [importlib.import_module(f"messages.{m.name}")
            for m in pkgutil.iter_modules(messages.__path__)]


def test_every_union_and_message_type_is_covered():
    unions = [u for u, _ in CASES]
    for module in _message_modules():  # every socket's union (To*/From*) is in CASES
        for name, value in vars(module).items():
            if name.startswith(("To", "From")) and (
                    isinstance(value, types.UnionType)
                    or isinstance(value, type) and issubclass(value, msgspec.Struct)):
                assert value in unions, f"{module.__name__}.{name} has no CASES entry"
    covered = {type(m) for _, m in CASES}
    for union in {u for u, _ in CASES}:
        for member in union_members(union):
            assert member in covered, member


def _structs_inside(value, out: set[type]) -> set[type]:
    if isinstance(value, msgspec.Struct):
        out.add(type(value))
        for field in value.__struct_fields__:
            _structs_inside(getattr(value, field), out)
    elif isinstance(value, list | tuple):
        for v in value:
            _structs_inside(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _structs_inside(v, out)
    return out


def test_every_struct_appears_in_some_case():
    # the nested ones too (SamplingParams inside a ScoredGroup, Response inside a ScoreRequest):
    # the round trip and the no-pickle check below see every field of every type
    present: set[type] = set()
    for _, message in CASES:
        _structs_inside(message, present)
    for module in _message_modules():
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, msgspec.Struct)
                    and value.__module__ == module.__name__):
                assert value in present, f"{value.__qualname__} appears in no CASES message"


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
    names = ", ".join(m.__name__ for m in _message_modules())
    code = f"import sys, {names}; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_pickle_detector_finds_pickles():
    # the check below is only as good as this: every protocol's stream is recognised
    value = msgspec.to_builtins(sample_group(), builtin_types=(bytes,))
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert is_pickle(pickle.dumps(value, protocol=protocol)), protocol
    assert not is_pickle(pickle.dumps(value)[:-1])  # no STOP: not a whole stream


def _lists(value):
    """msgpack has arrays, not tuples."""
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_lists(v) for v in value]
    return value


@pytest.mark.parametrize(("union", "message"), CASES, ids=CASE_IDS)
def test_no_frame_is_a_pickle_and_every_frame_is_plain_msgpack(union, message):
    # a routed message's frames (envelope, body) are both in CASES; so is every other frame
    # but the raw tensor bytes of weights, which ``from_buffer`` reads as numbers only
    frame = encode(message)
    assert not is_pickle(frame)
    # readable without any schema or extension type: plain maps, arrays, strings, numbers, bytes
    raw = msgspec.msgpack.decode(frame)
    assert raw == _lists(msgspec.to_builtins(message, builtin_types=(bytes,)))

    def no_ext(value) -> None:
        assert not isinstance(value, msgspec.msgpack.Ext), value
        for v in (value.values() if isinstance(value, dict) else
                  value if isinstance(value, list) else ()):
            no_ext(v)

    no_ext(raw)
    for leaf in byte_leaves(raw):  # nothing smuggled inside a bytes field either
        assert not is_pickle(leaf)
