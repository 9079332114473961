"""Policy versions and staleness, defined once (no torch: the replay buffer uses them).

A policy version counts the learner's optimizer steps: the initial weights are version 0 and
the weights after step ``s`` are version ``s`` (``version == step``, the learner's rule). Learner
step ``s`` trains with the weights of version ``s - 1``, and the replay buffer's ``version`` is
the learner's version when it asked for that step's batch.

Every generated token carries the version of the weights that produced it
(``Sample.token_versions``; one value per sample in recordings made before tokens carried
their own). A sample's version is that of its oldest token, a group's that of its oldest
sample: the behaviour policy the importance correction must reach back to.
"""

from __future__ import annotations

from typing import TypeVar

from messages.rollout import Sample, ScoredGroup

V = TypeVar("V")  # an int, or a tensor of versions (the learner's per-sample histogram)


def staleness(learner_version: int, behaviour_version: V) -> V:
    """Versions the behaviour policy lags the learner's ``learner_version`` (0: on-policy)."""
    return learner_version - behaviour_version  # type: ignore[operator, return-value]


def sample_version(sample: Sample) -> int:
    """The version of a sample's oldest token."""
    return sample.policy_version


def group_version(group: ScoredGroup) -> int:
    """The version of a group's oldest token (what its staleness is measured on)."""
    return min((sample_version(s) for s in group.samples), default=0)
