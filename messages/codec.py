"""One typed decoder per socket, built once; frames that do not decode are counted, never fatal."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")

encode = msgspec.msgpack.Encoder().encode

# A frame larger than this is refused before decoding (a defence against memory blow-up)
DEFAULT_MAX_FRAME = 256 * 1024 * 1024


class DecodeError(ValueError):
    """A frame that is not a valid message for this socket."""


class Codec(Generic[T]):
    """Decoder for one socket's union of message types, with a count of rejected frames.

    ``decode`` raises ``DecodeError`` (with msgspec's reason, e.g. the bad field path) for
    malformed, truncated, oversized or wrong-type frames; the caller answers or drops it and
    keeps running. ``rejected`` counts every such frame.
    """

    def __init__(self, union: Any, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)
        self.max_frame = max_frame
        self.rejected = 0  # frames that did not decode, since start

    def decode(self, frame: bytes | memoryview) -> T:
        if len(frame) > self.max_frame:
            self.rejected += 1
            raise DecodeError(f"frame of {len(frame)} bytes exceeds the {self.max_frame} limit")
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.rejected += 1
            raise DecodeError(str(exc)) from None
