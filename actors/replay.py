"""The replay buffer: the one owner of what data is in the system.

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

Dynamic sampling (DAPO, ``algorithm.filter_groups``): a group whose rewards are all equal is
dropped as ``filtered`` when it arrives; it leaves in_flight, so admission lets a replacement
prompt in. Prompts longer than ``task.max_prompt_length`` tokens are skipped when drawn and
counted in ``filtered_prompts``; they are never issued, so no other counter sees them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import zmq

from actors.datasets import prompt_token_counter
from actors.recording import Recorder, group_row
from actors.replay_resume import restore
from actors.runtime.actor import ActorContext
from actors.runtime.zmq_bridge import make_socket
from actors.tasks import Task, make_task
from messages.codec import Codec, DecodeError, encode
from messages.control import ErrorReply
from messages.rollout import (
    BatchRequest,
    GroupsDone,
    Prompt,
    PromptBatch,
    PromptRequest,
    ScoredGroup,
    ToReplay,
    TrainBatch,
    VersionUpdate,
)


def group_version(group: ScoredGroup) -> int:
    """The oldest policy version among a group's samples (what staleness is measured on)."""
    return min((s.policy_version for s in group.samples), default=0)


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
    staleness_hist: collections.Counter[int] = field(default_factory=collections.Counter)
    # rows for the run's recording (table, row), appended as things happen; the actor moves them
    # to its Recorder and flushes before it serves a batch (see actors/recording.py)
    records: list[tuple[str, dict]] = field(default_factory=list)
    record: bool = True  # run.record; off: groups rows are not even built (nothing is written)

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
        """Prompts for ``sampler``: requeued ones first, then new rows as admission allows."""
        out: list[Prompt] = []
        while self.requeued and len(out) < max_prompts:
            out.append(self.requeued.popleft())
            self.at_samplers[out[-1].prompt_id] = (sampler, out[-1])
        wanted = min(max_prompts - len(out), self.admissible())
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
        """A sampler restarted: its prompts in flight will never come back, so issue them again."""
        lost = [pid for pid, (who, _) in self.at_samplers.items() if who == sampler]
        for pid in sorted(lost):
            self.requeued.append(self.at_samplers.pop(pid)[1])
        return len(lost)

    def accept(self, group: ScoredGroup) -> bool:
        """Take a scored group for a prompt in flight; anything else is rejected and counted."""
        if self.at_samplers.pop(group.prompt.prompt_id, None) is None:
            self.rejected += 1
            return False
        if self.record:  # the groups row is the recording's one costly row: built only when kept
            self.records.append(("groups", group_row(group)))
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
        self.held.append(group)
        return True

    def _drop(self, group: ScoredGroup, reason: str) -> None:
        """Drop an accepted group for ``reason`` (counted and recorded)."""
        self.dropped[reason] += 1
        self.records.append(("fates", {
            "group_id": group.prompt.prompt_id, "fate": "dropped", "reason": reason, "step": -1,
            "position": -1, "served": 0, "version": self.version}))

    def drop_stale(self) -> int:
        """Drop held groups more than ``max_staleness`` versions behind the learner, and retire
        reusable ones that are (they were trained on, so they are not counted as dropped)."""
        keep: collections.deque[ScoredGroup] = collections.deque()
        n = 0
        for g in self.held:
            if self.version - group_version(g) > self.max_staleness:
                self._drop(g, "stale")
                n += 1
            else:
                keep.append(g)
        self.held = keep
        fresh: collections.deque[tuple[ScoredGroup, int]] = collections.deque()
        for g, served in self.reusable:
            if self.version - group_version(g) > self.max_staleness:
                self.retired += 1
                self.records.append(("fates", {
                    "group_id": g.prompt.prompt_id, "fate": "retired", "reason": "stale",
                    "step": -1, "position": -1, "served": served, "version": self.version}))
            else:
                fresh.append((g, served))
        self.reusable = fresh
        return n

    def take_batch(self, num_groups: int, step: int = 0) -> list[ScoredGroup] | None:
        """``num_groups`` groups for learner step ``step`` (the step about to be taken, counted
        from 1), or None while fewer are held: groups waiting for another serve first (they are
        the oldest, and waiting only makes them stale), then fresh ones in arrival order."""
        self.drop_stale()
        if len(self.reusable) + len(self.held) < num_groups:
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
            ages.append(self.version - group_version(g))
            serves.append(served)
            self.records.append(("fates", {
                "group_id": g.prompt.prompt_id, "fate": "trained", "reason": "", "step": step,
                "position": position, "served": served, "version": self.version}))
            for s in g.samples:
                self.staleness_hist[self.version - s.policy_version] += 1
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

    def counters(self) -> dict[str, int]:
        """issued = trained + dropped + in_flight and served = trained + reused hold at every
        moment."""
        return {
            "issued": self.issued,
            "trained": self.trained,
            "dropped": sum(self.dropped.values()),
            "dropped_stale": self.dropped["stale"],
            "dropped_filtered": self.dropped["filtered"],
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


async def replay_actor(ctx: ActorContext, *, task_status) -> None:
    """Serve prompts to samplers and batches to the learner over one ROUTER socket."""
    topo = ctx.topology
    filter_groups = topo.algorithm.filter_groups
    state = ReplayState(
        task=make_task(topo.task, topo.run.seed),
        groups_per_step=topo.learner.groups_per_step,
        max_staleness=topo.algorithm.max_staleness,
        capacity=topo.replay.capacity,
        record=topo.run.record,
        reuse=topo.replay.reuse,
        filter_groups=filter_groups.enable,
        max_filtered=filter_groups.max_num_gen_batches * topo.learner.groups_per_step,
        max_prompt_length=topo.task.max_prompt_length,
        # the tokenizer (not the model) is loaded, and only when prompts are length-filtered
        prompt_length=(prompt_token_counter(topo.model.path) if topo.task.max_prompt_length
                       else None),
    )
    codec: Codec[ToReplay] = Codec(ToReplay)
    sock = make_socket(ctx.zmq, zmq.ROUTER, bind=topo.replay.address, curve=ctx.curve)
    sock.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted sampler reclaims its name
    # waiting requests: one per peer at most, since each peer waits for its answer
    prompt_waiters: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    batch_waiter: tuple[bytes, BatchRequest] | None = None
    incarnations: dict[bytes, str] = {}
    if topo.learner.resume:  # continue the recorded run from the learner's latest checkpoint
        restored = restore(state, ctx.run_dir)
        if restored is not None:
            ctx.status.update(resumed_step=restored.step, redone=restored.redone)
    # the table order is the write-ahead order a resume relies on: a flush writes prompts, then
    # the groups of those prompts, then the fates of those groups (see actors/replay_resume.py)
    recorder = Recorder(ctx.run_dir, ["prompts", "groups", "fates"], enabled=topo.run.record)

    flushing = anyio.Lock()  # one flush at a time, so the tables' parts keep the WAL order

    async def record(tables: tuple[str, ...] | None = None) -> None:
        """Hand the state's rows to the recorder and write ``tables`` (default all) in a worker
        thread, in the WAL order. ``("prompts", "groups")`` is written ahead, when groups come
        in, so the flush a batch waits for is mostly its fates."""
        if not recorder.enabled:
            state.records.clear()
            return
        async with flushing:
            for table, row in state.records:
                recorder.append(table, row)
            state.records.clear()
            await anyio.to_thread.run_sync(recorder.flush, tables)

    async def serve_waiting() -> None:
        nonlocal batch_waiter
        if batch_waiter is not None:
            peer, req = batch_waiter
            groups = state.take_batch(req.num_groups, step=req.step + 1)
            if groups is not None:
                batch_waiter = None
                await record()  # what this batch consumed is on disk before the learner gets it
                msg = TrainBatch(step=req.step, groups=groups, counters=state.counters(),
                                 stats=state.batch_stats)
                await sock.send_multipart([peer, encode(msg)])
        for peer in list(prompt_waiters):
            prompts = state.issue(peer, prompt_waiters[peer])
            if not prompts:
                break  # admission closed: later waiters would get nothing either
            del prompt_waiters[peer]
            await sock.send_multipart([peer, encode(PromptBatch(prompts=prompts, version=state.version))])

    task_status.started()
    with sock:
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    peer, *frames = await sock.recv_multipart()
                    try:
                        msg = codec.decode(frames[-1]) if frames else codec.decode(b"")
                    except DecodeError as exc:
                        await sock.send_multipart([peer, encode(ErrorReply(error=f"replay: {exc}"))])
                        continue
                    match msg:
                        case PromptRequest(max_prompts=k, incarnation=inc):
                            if incarnations.get(peer, inc) != inc:
                                state.requeue_from(peer)
                            incarnations[peer] = inc
                            prompt_waiters[peer] = max(1, k)
                        case GroupsDone(groups=groups):
                            for g in groups:
                                state.accept(g)
                            if recorder.enabled and not flushing.locked():
                                tg.start_soon(record, ("prompts", "groups"))
                        case BatchRequest() as req:
                            state.version = max(state.version, req.version)
                            batch_waiter = (peer, req)
                        case VersionUpdate(version=v):
                            state.version = max(state.version, v)
                    await serve_waiting()
                    ctx.status.update(state.counters(), version=state.version,
                                      rejected_frames=codec.rejected)
        finally:
            with anyio.CancelScope(shield=True):
                await record()  # what was accepted since the last batch survives a stop
