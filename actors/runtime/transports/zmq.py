"""``zmq``: the tensors travel in the weights messages themselves (samplers on any host).

One message per bucket of tensors (``learner.weights_bucket_mb``), each a ``WeightsHeader``
frame and one zero-copy frame per tensor; the channel assembles the version's buckets and the
receiver hands the engine the tensors (read-only views of the frames).
"""

from __future__ import annotations

import torch

from actors.runtime.tensors import meta, raw_bytes
from actors.runtime.transports.base import Receiver, Sender
from actors.runtime.transports.sources import WeightsSource
from messages.codec import encode
from messages.weights import AdapterSpec, WeightsHeader


class ZmqSender(Sender):
    name = "zmq"

    async def prepare(self, version: int, tensors: list[tuple[str, torch.Tensor]], *,
                      bucket_bytes: int = 0, adapter: AdapterSpec | None = None
                      ) -> list[list]:
        """Messages of at most ``bucket_bytes`` of tensor data each (0: one message; a larger
        tensor travels alone)."""
        buckets = split_buckets(tensors, bucket_bytes)
        return [[encode(WeightsHeader(version=version, tensors=[meta(n, t) for n, t in b],
                                      bucket=i, buckets=len(buckets), adapter=adapter)),
                 *(raw_bytes(t) for _, t in b)] for i, b in enumerate(buckets)]


class ZmqReceiver(Receiver):
    name = "zmq"

    async def receive(self, header: WeightsHeader, parts: dict[str, torch.Tensor]
                      ) -> WeightsSource:
        return parts


def split_buckets(tensors: list[tuple[str, torch.Tensor]], limit: int
                  ) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``tensors`` of at most ``limit`` bytes each (0: all in one); a
    tensor larger than ``limit`` is a bucket of its own. Always at least one bucket."""
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if limit and buckets[-1] and size + n > limit:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += n
    return buckets

