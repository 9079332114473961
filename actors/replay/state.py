"""The replay buffer's state: the one owner of what data is in the system (no I/O here).

It issues prompts under admission control, holds scored groups, drops groups that have gone
stale, serves training batches, and keeps the counters that prove nothing accepted is lost:

    issued = trained + dropped + in_flight        (in_flight = at samplers + held here)
    served = trained + reused

``trained`` counts groups at their first serve; with ``replay.reuse = k > 1`` a group is served
again in up to ``k − 1`` later batches (``reused`` counts those serves), waiting in ``reusable``
in between (it is no longer in flight). A reusable group obeys ``max_staleness`` like a fresh
one, measured from the version that generated it, since that is the behaviour policy the
learner's importance weights correct for; once it is too old it is retired (recorded as fate
``retired``, reason ``stale``; it stays counted in ``trained``).

Admission (AReaL's rule): with learner version ``v``, staleness bound ``η`` and ``B`` groups per
step, at most ``(η + v + 1)·B − (trained + held + at_samplers)`` new prompts may be issued, and
never more than ``capacity`` groups may be held, reusable or in flight. With ``η = 0`` this is
synchronous RL: one batch is generated, trained on, then the next is issued. With reuse ``k``
the same rule is counted in serves: a group in flight is worth ``k`` serves and a reusable one
its serves left, so ``(η + v + 1)·B − (served + serves left + k·in_flight)`` serves' worth of
prompts may be issued (``k = 1`` is the rule above).

A group the sampler could not get scored (``ScoredGroup.score_error``: no reward worker answered
after ``sampler.score_attempts`` sends) is recorded and dropped as ``score_failed``; a prompt
the engine refused for good (``ScoredGroup.generate_error``: too long for the model's context)
comes back as a group without samples and is recorded and dropped as ``rejected``.

Dynamic sampling (DAPO, ``algorithm.filter_groups``): a group whose rewards are all equal is
dropped as ``filtered`` when it arrives; it leaves in_flight, so admission lets a replacement
prompt in. Prompts longer than ``task.max_prompt_length`` tokens are skipped when drawn and
counted in ``filtered_prompts``; they are never issued, so no other counter sees them.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from actors.data.tasks import Task
from actors.replay.resume import Recovered, read_recording
from actors.replay.schedule import FixedSchedule
from actors.runtime.recording import group_row
from actors.runtime.versions import group_version, staleness
from messages.rollout import Prompt, ScoredGroup


@dataclass
class ReplayState:
    """Admission, holding, staleness and batching, without any I/O (tested on its own)."""

    task: Task
    groups_per_step: int
    max_staleness: int
    capacity: int
    reuse: int = 1  # most batches one group is served in
    filter_groups: bool = False  # drop groups whose rewards are all equal (DAPO)
    max_filtered: int = 0  # most groups filtered between two served batches (0: no limit)
    max_prompt_length: int = 0  # skip prompts longer than this (0: no limit) ...
    prompt_length: Callable[[Prompt], int] | None = None  # ... as counted by this
    version: int = 0  # the learner's current policy version
    # the next draw of the task; every draw is issued or skipped, in order. Resume sets it from
    # the recorded prompts' (dataset, row): task.index_after({dataset: last row + 1})
    next_row: int = 0
    issued: int = 0  # prompts ever issued (each prompt id counted once)
    trained: int = 0  # groups handed to the learner, each counted once (at its first serve)
    served: int = 0  # groups handed to the learner, each serve counted (= trained + reused)
    reused: int = 0  # serves after a group's first
    retired: int = 0  # reusable groups that went stale before their last serve
    filtered_prompts: int = 0  # draws skipped as longer than max_prompt_length (never issued)
    # served groups waiting for another serve, with their serve count so far (not in flight)
    reusable: collections.deque[tuple[ScoredGroup, int]] = field(default_factory=collections.deque)
    # since the last batch served, for that step's metrics
    step_filtered: int = 0
    step_filtered_prompts: int = 0
    # stats of the last batch served (TrainBatch.stats)
    batch_stats: dict[str, float] = field(default_factory=dict)
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    rejected: int = 0  # groups that did not belong to a prompt in flight (duplicates, unknown)
    held: collections.deque[ScoredGroup] = field(default_factory=collections.deque)
    at_samplers: dict[int, tuple[bytes, Prompt]] = field(default_factory=dict)
    requeued: collections.deque[Prompt] = field(default_factory=collections.deque)
    # rows for the run's recording (table, row), appended as things happen; the actor moves them
    # to its Recorder and flushes before it serves a batch (see actors/runtime/recording.py)
    records: list[tuple[str, dict]] = field(default_factory=list)
    record: bool = True  # run.record; off: groups rows are not even built (nothing is written)
    # set once scoring failed past reward.max_error_share (actors/replay/errors.py): groups with
    # a failed sample are dropped as score_errors from then on, so none is ever served
    refuse_failed: bool = False
    # run.deterministic: prompts go out in whole batches of their place, batches are served in
    # prompt order, ``held`` is kept in prompt order (actors/replay/schedule.py); None: by timing
    schedule: FixedSchedule | None = None

    @property
    def in_flight(self) -> int:
        return len(self.at_samplers) + len(self.requeued) + len(self.held)

    def admissible(self) -> int:
        """How many prompts may be issued right now (requeued ones count as already issued)."""
        k = self.reuse
        committed = (self.served + sum(k - n for _, n in self.reusable) + k * self.in_flight)
        bound = ((self.max_staleness + self.version + 1) * self.groups_per_step - committed) // k
        room = self.capacity - self.in_flight - len(self.reusable)
        return max(0, min(bound, room))

    def issue(self, sampler: bytes, max_prompts: int) -> list[Prompt]:
        """Prompts for ``sampler``: requeued ones first, then new rows as admission allows
        (a deterministic run: one whole batch of the schedule, whatever was asked)."""
        if self.schedule is not None:
            return self._issue_batch(sampler)
        out: list[Prompt] = []
        while self.requeued and len(out) < max_prompts:
            out.append(self.requeued.popleft())
            self.at_samplers[out[-1].prompt_id] = (sampler, out[-1])
        return out + self._draw(sampler, min(max_prompts - len(out), self.admissible()))

    def _issue_batch(self, sampler: bytes) -> list[Prompt]:
        """The schedule's next batch, once the learner has the version it is generated with:
        the lowest batch given back, else a new one as admission allows."""
        S = self.schedule
        assert S is not None
        if self.requeued:
            b = min(S.batch_of(p.prompt_id) for p in self.requeued)
            if S.version_of(b) > self.version:
                return []
            out = sorted((p for p in self.requeued if S.batch_of(p.prompt_id) == b),
                         key=lambda p: p.prompt_id)
            self.requeued = collections.deque(p for p in self.requeued
                                              if S.batch_of(p.prompt_id) != b)
            for p in out:
                self.at_samplers[p.prompt_id] = (sampler, p)
            return out
        G = S.groups_per_step
        if S.version_of(S.batch_of(self.issued)) > self.version or self.admissible() < G:
            return []
        return self._draw(sampler, G)

    def issued_as(self, prompts: list[Prompt]) -> tuple[int, int]:
        """``(version, seed)`` of a batch ``issue`` returned: the learner's version and no seed,
        or in a deterministic run the schedule's version and seed of the batch."""
        if self.schedule is None:
            return self.version, -1
        b = self.schedule.batch_of(prompts[0].prompt_id)
        return self.schedule.version_of(b), self.schedule.seed_of(b)

    def lowest_out(self) -> int | None:
        """The lowest prompt id at a sampler or waiting to be issued again (None: none)."""
        return min(itertools.chain(self.at_samplers, (p.prompt_id for p in self.requeued)),
                   default=None)

    def publish_ready(self, version: int) -> bool:
        """A deterministic run: whether the learner may publish ``version``
        (``FixedSchedule.publish_ready``)."""
        assert self.schedule is not None
        return self.schedule.publish_ready(version, self.issued, self.lowest_out())

    def _draw(self, sampler: bytes, wanted: int) -> list[Prompt]:
        """``wanted`` new prompts from the task for ``sampler`` (too long ones skipped)."""
        out: list[Prompt] = []
        skipped = 0
        while wanted > 0:
            dataset, row = self.task.locate(self.next_row)
            prompt = self.task.prompt_at(dataset, row, prompt_id=self.issued)
            self.next_row += 1
            if self.max_prompt_length and self.prompt_length is not None \
                    and self.prompt_length(prompt) > self.max_prompt_length:
                self.filtered_prompts += 1
                self.step_filtered_prompts += 1
                skipped += 1
                if skipped >= 10_000:
                    raise ValueError(f"10000 prompts in a row are longer than "
                                     f"task.max_prompt_length = {self.max_prompt_length} tokens")
                continue
            out.append(prompt)
            self.at_samplers[prompt.prompt_id] = (sampler, prompt)
            self.records.append(("prompts", {"prompt_id": self.issued, "row": row,
                                             "dataset": dataset}))
            self.issued += 1
            wanted -= 1
        return out

    def requeue_from(self, sampler: bytes) -> int:
        """A sampler restarted, left (``SamplerLeaving``) or went silent: its prompts in flight
        will not come back, so issue them again."""
        lost = [pid for pid, (who, _) in self.at_samplers.items() if who == sampler]
        for pid in sorted(lost):
            self.requeued.append(self.at_samplers.pop(pid)[1])
        return len(lost)

    def accept(self, group: ScoredGroup) -> bool:
        """Take a scored group for a prompt in flight; anything else is rejected and counted.
        A group names its prompt by id, without its images: the issued prompt's are put back
        (the learner rebuilds the pixel tensors from them)."""
        issued = self.at_samplers.pop(group.prompt.prompt_id, None)
        if issued is None:
            self.rejected += 1
            return False
        if issued[1].images and not group.prompt.images:
            group.prompt = msgspec.structs.replace(group.prompt, images=issued[1].images)
        if self.record:  # the groups row is the recording's one costly row: built only when kept
            self.records.append(("groups", group_row(group)))
        if group.generate_error:  # the engine refused the prompt: retrying cannot help
            self._drop(group, "rejected")
            return True
        if group.score_error:  # no reward worker answered: its rewards are not rewards
            self._drop(group, "score_failed")
            return True
        if self.refuse_failed and any(s.reward_error for s in group.samples):
            self._drop(group, "score_errors")
            return True
        if self.filter_groups and len({s.reward for s in group.samples}) <= 1:
            self._drop(group, "filtered")
            self.step_filtered += 1
            if self.max_filtered and self.step_filtered > self.max_filtered:
                raise RuntimeError(
                    f"{self.step_filtered} groups filtered (all rewards equal) since the last "
                    f"batch, more than algorithm.filter_groups.max_num_gen_batches × "
                    f"groups_per_step = {self.max_filtered}: the prompts are too hard or too "
                    f"easy for the model (raise max_num_gen_batches, 0 = no limit)")
            return True
        if self.schedule is None:
            self.held.append(group)
        else:  # kept in prompt order: a batch is the lowest ids
            ids = [g.prompt.prompt_id for g in self.held]
            self.held.insert(bisect.bisect(ids, group.prompt.prompt_id), group)
        return True

    def _drop(self, group: ScoredGroup, reason: str) -> None:
        """Drop an accepted group for ``reason`` (counted and recorded)."""
        self.dropped[reason] += 1
        self.records.append(("fates", {
            "group_id": group.prompt.prompt_id, "fate": "dropped", "reason": reason, "step": -1,
            "position": -1, "served": 0, "version": self.version}))

    def drop_failed(self) -> int:
        """Scoring failed past its bound: drop every held group with a failed sample (recorded,
        reason ``score_errors``), now and as they come in; returns how many were held."""
        self.refuse_failed = True
        keep: collections.deque[ScoredGroup] = collections.deque()
        for g in self.held:
            if any(s.reward_error for s in g.samples):
                self._drop(g, "score_errors")
            else:
                keep.append(g)
        n = len(self.held) - len(keep)
        self.held = keep
        return n

    def drop_stale(self) -> int:
        """Drop held groups more than ``max_staleness`` versions behind the learner, and retire
        reusable ones that are (they were trained on, so they are not counted as dropped)."""
        keep: collections.deque[ScoredGroup] = collections.deque()
        n = 0
        for g in self.held:
            if staleness(self.version, group_version(g)) > self.max_staleness:
                self._drop(g, "stale")
                n += 1
            else:
                keep.append(g)
        self.held = keep
        fresh: collections.deque[tuple[ScoredGroup, int]] = collections.deque()
        for g, served in self.reusable:
            if staleness(self.version, group_version(g)) > self.max_staleness:
                self.retired += 1
                self.records.append(("fates", {
                    "group_id": g.prompt.prompt_id, "fate": "retired", "reason": "stale",
                    "step": -1, "position": -1, "served": served, "version": self.version}))
            else:
                fresh.append((g, served))
        self.reusable = fresh
        return n

    def peek_batch(self, num_groups: int) -> list[ScoredGroup] | None:
        """The groups ``take_batch(num_groups)`` would take now, in its order (reusable ones
        first, then fresh ones), or None while fewer are held; nothing changes."""
        if len(self.reusable) + len(self.held) < num_groups or not self._in_order(num_groups):
            return None
        ahead = [g for g, _ in itertools.islice(self.reusable, num_groups)]
        return ahead + list(itertools.islice(self.held, num_groups - len(ahead)))

    def take_batch(self, num_groups: int, step: int = 0) -> list[ScoredGroup] | None:
        """``num_groups`` groups for learner step ``step`` (the step about to be taken, counted
        from 1), or None while fewer are held: groups waiting for another serve first (they are
        the oldest, and waiting only makes them stale), then fresh ones in arrival order."""
        self.drop_stale()
        if len(self.reusable) + len(self.held) < num_groups or not self._in_order(num_groups):
            return None
        taken = [self.reusable.popleft() for _ in range(min(num_groups, len(self.reusable)))]
        taken += [(self.held.popleft(), 0) for _ in range(num_groups - len(taken))]
        ages, serves = [], []
        for position, (g, before) in enumerate(taken):
            served = before + 1
            if served == 1:
                self.trained += 1
            else:
                self.reused += 1
            self.served += 1
            if served < self.reuse:
                self.reusable.append((g, served))
            ages.append(staleness(self.version, group_version(g)))
            serves.append(served)
            self.records.append(("fates", {
                "group_id": g.prompt.prompt_id, "fate": "trained", "reason": "", "step": step,
                "position": position, "served": served, "version": self.version}))
        self.batch_stats = {
            "step_filtered": float(self.step_filtered),
            "step_filtered_prompts": float(self.step_filtered_prompts),
            "step_reused": float(sum(n > 1 for n in serves)),
            "age_versions_mean": sum(ages) / len(ages) if ages else 0.0,
            "age_versions_max": float(max(ages, default=0)),
            "age_served_mean": sum(serves) / len(serves) if serves else 0.0,
            "age_served_max": float(max(serves, default=0)),
        }
        self.step_filtered = self.step_filtered_prompts = 0
        return [g for g, _ in taken]

    def _in_order(self, num_groups: int) -> bool:
        """A deterministic run serves the lowest prompt ids only once none before them is out
        (``FixedSchedule.ready``); a run by timing, whatever is held."""
        if self.schedule is None:
            return True
        ids = [g.prompt.prompt_id for g in itertools.islice(self.held, num_groups)]
        return len(ids) == num_groups and (
            (out := self.lowest_out()) is None or ids[-1] < out)

    def counters(self) -> dict[str, int]:
        """issued = trained + dropped + in_flight and served = trained + reused hold at every
        moment."""
        return {
            "issued": self.issued,
            "trained": self.trained,
            "dropped": sum(self.dropped.values()),
            "dropped_stale": self.dropped["stale"],
            "dropped_filtered": self.dropped["filtered"],
            "dropped_score_failed": self.dropped["score_failed"],
            "dropped_rejected": self.dropped["rejected"],
            "dropped_score_errors": self.dropped["score_errors"],
            "in_flight": self.in_flight,
            "held": len(self.held),
            "at_samplers": len(self.at_samplers) + len(self.requeued),
            "rejected": self.rejected,
            "served": self.served,
            "reused": self.reused,
            "reusable": len(self.reusable),
            "retired": self.retired,
            "filtered_prompts": self.filtered_prompts,
        }

    def restore(self, run_dir: Path, step: int | None = None,
                version: int | None = None) -> Recovered | None:
        """Become the buffer recorded in ``run_dir`` as of checkpoint ``step`` (default: the
        latest checkpoint's), as ``actors/replay/resume.py`` explains; call it on a fresh state.
        Returns what was recovered, or None (leaving the state as it is) when nothing was
        recorded. Appends nothing to ``records``: every row it read is already on disk."""
        found = read_recording(run_dir, self.reuse, step, version)
        if found is None:
            return None
        self.version = found.version
        self.issued = found.issued
        self.next_row = self.task.index_after(found.next_rows)
        self.trained, self.reused, self.retired = found.trained, found.reused, found.retired
        self.served = found.trained + found.reused
        self.dropped = collections.Counter(found.dropped)
        self.held = collections.deque(found.held if self.schedule is None else
                                      sorted(found.held, key=lambda g: g.prompt.prompt_id))
        self.reusable = collections.deque(found.reusable)
        self.requeued = collections.deque(self.task.prompt_at(dataset, row, prompt_id=pid)
                                          for dataset, row, pid in found.requeued)
        self.at_samplers = {}
        return found
