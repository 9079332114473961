"""Within the learner's group: rank 0 tells the other ranks what to do next.

Not a ZeroMQ socket: rank 0 broadcasts each message's bytes over torch.distributed (a uint8
tensor, its length first; ``Group.broadcast_control`` in ``actors/learner/distributed.py``), on a
gloo side group of CPU tensors with no practical timeout, never on NCCL: a follower may wait
for the next message as long as rank 0 legitimately takes (vLLM's start, a long first batch, a
checkpoint write) without a collective watchdog killing it. Every rank decodes it with
one typed decoder, as on any socket. Each message starts a collective that every rank then
runs, in the order rank 0 sent them; rank 0 alone talks to the replay buffer, the samplers and
the runner, so the other ranks learn the batch, and when to publish, save or stop, from here.
"""

from __future__ import annotations

import msgspec

from messages.rollout import ScoredGroup


class RanksStep(msgspec.Struct, tag=True, gc=False):
    """Rank 0 -> ranks: take one training step on these groups (the whole batch)."""

    groups: list[ScoredGroup]


class RanksPublish(msgspec.Struct, tag=True):
    """Rank 0 -> ranks: gather the weights (rank 0 sends them to the samplers) in ``dtype``."""

    dtype: str


class RanksSave(msgspec.Struct, tag=True):
    """Rank 0 -> ranks: write a checkpoint of the current step."""


class RanksEnd(msgspec.Struct, tag=True):
    """Rank 0 -> ranks: the learner is done; leave the group and exit."""


ToLearnerRanks = RanksStep | RanksPublish | RanksSave | RanksEnd
