"""One typed decoder per socket, built once; frames that do not decode are counted, never fatal.

A codec given the name of its socket also says why it refused a frame, on stderr: the first
rejection of each kind at once, later ones of that kind at most once a minute with how many
came since, so a peer sending garbage at a high rate cannot flood the log (the count stays
exact: ``rejected``, which actors publish in their status as ``rejected_frames``, and
``kinds``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")

encode = msgspec.msgpack.Encoder().encode

# A frame larger than this is refused before decoding (a defence against memory blow-up)
DEFAULT_MAX_FRAME = 256 * 1024 * 1024


# Seconds between two log lines of one kind of rejection on one socket (the first is at once)
REJECT_LOG_INTERVAL_S = 60.0


class DecodeError(ValueError):
    """A frame that is not a valid message for this socket."""


def rejection_kind(reason: str) -> str:
    """The kind of a decode failure, from msgspec's reason (a log line and a count per kind)."""
    if "exceeds" in reason:
        return "oversized"
    if "truncated" in reason:
        return "truncated"
    if "malformed" in reason:
        return "not msgpack"
    if "Invalid UTF-8" in reason:  # msgspec >= 0.23 (earlier ones raise UnicodeDecodeError)
        return "not utf-8"
    if "at `$.type`" in reason or "missing required field `type`" in reason:
        return "wrong type"
    if reason.startswith("Expected `object`") and " - at `$" not in reason:
        return "not a message"  # msgpack, but not a map
    return "bad field"


class Codec(Generic[T]):
    """Decoder for one socket's union of message types, with a count of rejected frames.

    ``decode`` raises ``DecodeError`` (with msgspec's reason, e.g. the bad field path) for
    malformed, truncated, oversized or wrong-type frames; the caller answers or drops it and
    keeps running. ``rejected`` counts every such frame, and every message the caller refuses
    after decoding (``refuse``: a request without its body); ``kinds`` counts them by kind.
    With a ``socket`` name, rejections are logged (rate-limited per kind, see above).
    """

    def __init__(self, union: Any, *, max_frame: int = DEFAULT_MAX_FRAME, socket: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)
        self.max_frame = max_frame
        self.socket = socket  # named in the log lines; "" logs nothing
        self._clock = clock
        self.rejected = 0  # frames that did not decode or were refused, since start
        self.kinds: dict[str, int] = {}  # rejected, by kind; sums to ``rejected``
        self._logged: dict[str, tuple[float, int]] = {}  # kind -> (last logged, its count then)

    def decode(self, frame: bytes | memoryview) -> T:
        if len(frame) > self.max_frame:
            raise self.refuse(f"frame of {len(frame)} bytes exceeds the {self.max_frame} limit")
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise self.refuse(str(exc)) from None
        except UnicodeDecodeError as exc:  # a string that is not UTF-8 (msgspec < 0.23: its own
            # error types do not cover it): it would escape every caller's ``except DecodeError``
            raise self.refuse(f"a string is not UTF-8: {exc}", "not utf-8") from None

    def refuse(self, reason: str, kind: str = "") -> DecodeError:
        """Count (and log) a rejected frame; returns the error to raise or report. ``kind``
        defaults to the one ``rejection_kind`` reads from the reason."""
        kind = kind or rejection_kind(reason)
        self.rejected += 1
        n = self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if self.socket:
            now = self._clock()
            last, seen = self._logged.get(kind, (-REJECT_LOG_INTERVAL_S, 0))
            if now - last >= REJECT_LOG_INTERVAL_S:
                self._logged[kind] = (now, n)
                more = f" ({n - seen} of this kind since the last line)" if seen else ""
                print(f"{self.socket}: rejected a frame ({kind}): {reason[:200]}{more}; more of "
                      f"this kind are counted, logged at most every {REJECT_LOG_INTERVAL_S:g} s",
                      file=sys.stderr, flush=True)
        return DecodeError(reason)
