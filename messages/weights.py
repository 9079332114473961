"""Weights flow: Learner -> Samplers, versioned, as zero-copy frames.

Sockets: the learner binds a ROUTER (``weights`` address); each sampler connects a DEALER and
long-polls with ``WeightsPoll(have_version)``. When the learner holds a newer version it answers
with ``buckets`` messages in a row, each a ``WeightsHeader`` frame followed by one raw frame per
tensor of that bucket, in header order (a version is never one message the size of the model).
A slow sampler therefore only ever receives the newest weights, never a queue of stale ones.
"""

from __future__ import annotations

import msgspec

from messages.tensor import TensorMeta


class WeightsPoll(msgspec.Struct, tag=True, gc=False):
    """Sampler -> Learner: send me weights newer than ``have_version`` when there are some."""

    have_version: int


class WeightsHeader(msgspec.Struct, tag=True, gc=False):
    """Learner -> Sampler: frame 0 of a weights message; frames 1.. are the tensors' bytes."""

    version: int
    tensors: list[TensorMeta]
    path: str = ""  # shared-memory transport: a safetensors file on the sampler's own host
    # holds the tensors (``tensors`` is then empty and no tensor frames follow)
    bucket: int = 0  # this message's place among the version's messages
    buckets: int = 1  # messages the version is sent in, each one bucket of tensors


ToLearnerWeights = WeightsPoll
FromLearnerWeights = WeightsHeader
