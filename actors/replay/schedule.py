"""The fixed schedule of a deterministic run (``run.deterministic``): where each prompt goes
follows from its place in the run, never from when something arrived (no I/O here).

Prompts are issued in whole generation batches: batch ``b`` is the prompts with ids
``b·G .. b·G + G - 1`` (``G = learner.groups_per_step``), the groups step ``b + 1`` trains on.
It is generated as one batch, with weights version ``max(0, b - η)`` (``η =
algorithm.max_staleness``) and a seed of its own (``seed``), by whichever sampler asks first:
a batch given back (a sampler restarted, left or went silent) is issued again whole, with the
same version and seed.

Two rules make every batch find exactly its version as the newest one published:

- batch ``b`` is issued only once the learner's version has reached ``b - η`` (admission does
  this already; requeued batches wait for it too);
- the learner publishes version ``v`` only once every batch due on ``v - 1`` (those up to
  ``v - 1 + η``) is back and on disk, and the validation round of ``v - 1`` (if one is due) is
  back (``publish_ready``).

So while batch ``b`` is out, the newest version is ``b - η``, for a sampler that restarts too;
and a checkpoint of step ``s`` (written after version ``s`` went out) finds every group made
with an older version on disk, so a resume regenerates only groups of versions it can publish.
A training batch is the ``G`` held groups of lowest prompt ids, served once no prompt of a
lower id is still out (``ready``): prompt order, not arrival order.

Validation rounds come in fixed chunks of ``G`` prompts (``validation_seed``), generated with
the validated version (the learner waits for the round before publishing the next).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass


def _seed(*parts: int) -> int:
    """A seed in [0, 2**31) from ``parts``, the same in every process and on every machine."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class FixedSchedule:
    groups_per_step: int  # G: prompts per generation batch, groups per training batch
    max_staleness: int  # η: versions between a batch's weights and the learner that trains it
    seed: int  # run.seed

    def batch_of(self, prompt_id: int) -> int:
        return prompt_id // self.groups_per_step

    def version_of(self, batch: int) -> int:
        """The weights version batch ``batch`` is generated with."""
        return max(0, batch - self.max_staleness)

    def seed_of(self, batch: int) -> int:
        """The seed of the draws of training batch ``batch``."""
        return _seed(self.seed, 0, batch)

    def validation_seed(self, step: int, first_prompt: int) -> int:
        """The seed of the validation chunk of round ``step`` that starts at ``first_prompt``."""
        return _seed(self.seed, 1, step, first_prompt)

    def publish_ready(self, version: int, issued: int, lowest_out: int | None) -> bool:
        """Whether ``version`` may go out: every prompt of the batches due on ``version - 1``
        has been issued and is no longer out (``lowest_out``: the lowest prompt id still at a
        sampler or waiting to be issued again, None when none is)."""
        if version <= 0:
            return True
        end = (version + self.max_staleness) * self.groups_per_step  # ids before it are due
        return issued >= end and (lowest_out is None or lowest_out >= end)

    def ready(self, held_ids: list[int], lowest_out: int | None) -> bool:
        """Whether the next training batch can be served: ``G`` groups are held (``held_ids``:
        their prompt ids in increasing order) and no prompt before the ``G``-th is still out."""
        G = self.groups_per_step
        return len(held_ids) >= G and (lowest_out is None or held_ids[G - 1] < lowest_out)


def lowest(ids: Iterable[int]) -> int | None:
    return min(ids, default=None)
