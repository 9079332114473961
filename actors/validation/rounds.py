"""The replay buffer's account of validation rounds (no I/O, tested on its own).

A round validates the policy after ``step`` learner steps: when the learner's version reaches a
step that is due (0 with ``before_training``; every ``every`` steps and the last step, with
``every > 0``), the round's prompts queue up, and samplers asking for prompts get them before
any training prompt (they generate with weights of that version: the learner has published them
before the buffer learns the version). Its prompts are counted apart from training prompts
(for the running round, ``done + out + waiting = prompts`` at every moment; over the run,
``val_returned`` groups came back of ``val_issued`` handed out, re-issues included) and they
never enter admission, ``issued``, ``trained``, ``dropped`` or ``in_flight``. A
sampler that restarts gives its round prompts back (issued again, like training prompts). A
round is complete when a group of each of its prompts is back; then the buffer computes its
metrics, records it, and reports it.

At most one round runs and one waits: a round that comes due while another waits replaces it
(counted in ``skipped``), so slow validation never piles up behind a fast learner.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from messages.rollout import Prompt, ScoredGroup


@dataclass
class Round:
    step: int  # the policy version validated
    prompts: int  # prompts in the round
    waiting: collections.deque[Prompt]  # not issued yet (or given back by a restarted sampler)
    out: dict[int, tuple[bytes, Prompt]] = field(default_factory=dict)  # at samplers, by id
    done: dict[int, ScoredGroup] = field(default_factory=dict)  # back, by prompt id
    started: float | None = None  # when its first prompt was issued
    generate_s: float = 0.0  # generation seconds of its batches, summed over samplers

    @property
    def complete(self) -> bool:
        return len(self.done) == self.prompts


@dataclass
class ValidationRounds:
    prompts: list[Prompt]  # the validation set (ids 0..len-1)
    every: int
    before_training: bool
    total_steps: int
    version: int = -1  # the newest learner version seen (-1: none yet)
    recorded: set[int] = field(default_factory=set)  # steps validated before (a resume's)
    active: Round | None = None
    queued: Round | None = None
    issued: int = 0  # validation prompts handed to samplers, re-issues included
    returned: int = 0  # validation groups accepted
    rejected: int = 0  # groups for no prompt out (duplicates, an old round's)
    rounds: int = 0  # rounds completed
    skipped: int = 0  # rounds replaced while waiting

    def due(self, step: int) -> bool:
        if not self.prompts or step in self.recorded:
            return False
        if step == 0:
            return self.before_training
        return self.every > 0 and (step % self.every == 0 or step == self.total_steps)

    def advance(self, version: int) -> None:
        """The learner's version is now ``version``: queue the rounds that came due (from the
        first version seen, the start or a resume's checkpoint, onwards)."""
        start = self.version + 1 if self.version >= 0 else version
        for step in range(start, version + 1):
            if self.due(step):
                self._queue(step)
        self.version = max(self.version, version)

    def _queue(self, step: int) -> None:
        if self.active is not None and self.queued is not None:
            self.skipped += 1
        fresh = Round(step, len(self.prompts), collections.deque(self.prompts))
        if self.active is None:
            self.active = fresh
        else:
            self.queued = fresh

    def issue(self, sampler: bytes, max_prompts: int, now: float) -> tuple[int, list[Prompt]]:
        """``(step, prompts)`` of the running round for ``sampler`` (no prompts: none waiting)."""
        r = self.active
        if r is None or not r.waiting:
            return -1, []
        out: list[Prompt] = []
        while r.waiting and len(out) < max_prompts:
            p = r.waiting.popleft()
            r.out[p.prompt_id] = (sampler, p)
            out.append(p)
        if r.started is None:
            r.started = now
        self.issued += len(out)
        return r.step, out

    def requeue_from(self, sampler: bytes) -> int:
        """A sampler restarted: the round prompts it held go back to the front."""
        r = self.active
        if r is None:
            return 0
        lost = sorted(pid for pid, (who, _) in r.out.items() if who == sampler)
        for pid in reversed(lost):
            r.waiting.appendleft(r.out.pop(pid)[1])
        return len(lost)

    def accept(self, step: int, groups: list[ScoredGroup]) -> Round | None:
        """Take a sampler's scored validation groups of round ``step``; returns the round when
        they complete it (the next round, if one waits, becomes the running one)."""
        r = self.active
        if r is None or r.step != step:
            self.rejected += len(groups)
            return None
        fresh = [g for g in groups if r.out.pop(g.prompt.prompt_id, None) is not None]
        self.rejected += len(groups) - len(fresh)
        for g in fresh:
            r.done[g.prompt.prompt_id] = g
        self.returned += len(fresh)
        if fresh:
            r.generate_s += max(g.generate_seconds for g in fresh)  # one batch: one generation
        if not r.complete:
            return None
        self.rounds += 1
        self.recorded.add(r.step)
        self.active, self.queued = self.queued, None
        return r

    @property
    def out(self) -> int:
        return len(self.active.out) if self.active is not None else 0

    def status(self) -> dict[str, int]:
        """For the replay buffer's status (the live view shows the running round)."""
        r = self.active
        out = {"val_issued": self.issued, "val_returned": self.returned, "val_out": self.out,
               "val_rounds": self.rounds, "val_skipped": self.skipped}
        out.update(val_step=r.step if r is not None else -1,
                   val_done=len(r.done) if r is not None else 0,
                   val_total=r.prompts if r is not None else 0)
        return out
