"""The replay buffer: the one owner of what data is in the system.

It issues prompts under admission control, holds scored groups, drops groups that have gone
stale, serves training batches, and keeps the counters that prove nothing accepted is lost:

    issued = trained + dropped + in_flight        (in_flight = at samplers + held here)

Admission (AReaL's rule, counted in groups): with learner version ``v``, staleness bound ``η``
and ``B`` groups per step, at most ``(η + v + 1)·B − (trained + held + at_samplers)`` new
prompts may be issued, and never more than ``capacity`` groups may be held or in flight. With
``η = 0`` this is synchronous RL: one batch is generated, trained on, then the next is issued.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import zmq

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
    version: int = 0  # the learner's current policy version
    next_row: int = 0  # dataset position: rows are issued in order
    issued: int = 0  # prompts ever issued (each prompt id counted once)
    trained: int = 0  # groups handed to the learner
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    rejected: int = 0  # groups that did not belong to a prompt in flight (duplicates, unknown)
    held: collections.deque[ScoredGroup] = field(default_factory=collections.deque)
    at_samplers: dict[int, tuple[bytes, Prompt]] = field(default_factory=dict)
    requeued: collections.deque[Prompt] = field(default_factory=collections.deque)
    staleness_hist: collections.Counter[int] = field(default_factory=collections.Counter)

    @property
    def in_flight(self) -> int:
        return len(self.at_samplers) + len(self.requeued) + len(self.held)

    def admissible(self) -> int:
        """How many prompts may be issued right now (requeued ones count as already issued)."""
        bound = (self.max_staleness + self.version + 1) * self.groups_per_step - (
            self.trained + self.in_flight
        )
        room = self.capacity - self.in_flight
        return max(0, min(bound, room))

    def issue(self, sampler: bytes, max_prompts: int) -> list[Prompt]:
        """Prompts for ``sampler``: requeued ones first, then new rows as admission allows."""
        out: list[Prompt] = []
        while self.requeued and len(out) < max_prompts:
            out.append(self.requeued.popleft())
            self.at_samplers[out[-1].prompt_id] = (sampler, out[-1])
        for _ in range(min(max_prompts - len(out), self.admissible())):
            out.append(self.task.prompt(self.next_row, prompt_id=self.issued))
            self.at_samplers[out[-1].prompt_id] = (sampler, out[-1])
            self.next_row += 1
            self.issued += 1
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
        self.held.append(group)
        return True

    def drop_stale(self) -> int:
        """Drop held groups more than ``max_staleness`` versions behind the learner."""
        keep: collections.deque[ScoredGroup] = collections.deque()
        n = 0
        for g in self.held:
            if self.version - group_version(g) > self.max_staleness:
                self.dropped["stale"] += 1
                n += 1
            else:
                keep.append(g)
        self.held = keep
        return n

    def take_batch(self, num_groups: int) -> list[ScoredGroup] | None:
        """The oldest ``num_groups`` fresh groups, or None while fewer are held."""
        self.drop_stale()
        if len(self.held) < num_groups:
            return None
        batch = [self.held.popleft() for _ in range(num_groups)]
        self.trained += len(batch)
        for g in batch:
            for s in g.samples:
                self.staleness_hist[self.version - s.policy_version] += 1
        return batch

    def counters(self) -> dict[str, int]:
        """issued = trained + dropped + in_flight holds at every moment."""
        return {
            "issued": self.issued,
            "trained": self.trained,
            "dropped": sum(self.dropped.values()),
            "dropped_stale": self.dropped["stale"],
            "in_flight": self.in_flight,
            "held": len(self.held),
            "at_samplers": len(self.at_samplers) + len(self.requeued),
            "rejected": self.rejected,
        }


async def replay_actor(ctx: ActorContext, *, task_status) -> None:
    """Serve prompts to samplers and batches to the learner over one ROUTER socket."""
    topo = ctx.topology
    state = ReplayState(
        task=make_task(topo.task, topo.run.seed),
        groups_per_step=topo.learner.groups_per_step,
        max_staleness=topo.algorithm.max_staleness,
        capacity=topo.replay.capacity,
    )
    codec: Codec[ToReplay] = Codec(ToReplay)
    sock = make_socket(ctx.zmq, zmq.ROUTER, bind=topo.replay.address, curve=ctx.curve)
    sock.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted sampler reclaims its name
    # waiting requests: one per peer at most, since each peer waits for its answer
    prompt_waiters: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    batch_waiter: tuple[bytes, BatchRequest] | None = None
    incarnations: dict[bytes, str] = {}

    async def serve_waiting() -> None:
        nonlocal batch_waiter
        if batch_waiter is not None:
            peer, req = batch_waiter
            groups = state.take_batch(req.num_groups)
            if groups is not None:
                batch_waiter = None
                msg = TrainBatch(step=req.step, groups=groups, counters=state.counters())
                await sock.send_multipart([peer, encode(msg)])
        for peer in list(prompt_waiters):
            prompts = state.issue(peer, prompt_waiters[peer])
            if not prompts:
                break  # admission closed: later waiters would get nothing either
            del prompt_waiters[peer]
            await sock.send_multipart([peer, encode(PromptBatch(prompts=prompts, version=state.version))])

    task_status.started()
    with sock:
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
                case BatchRequest() as req:
                    state.version = max(state.version, req.version)
                    batch_waiter = (peer, req)
                case VersionUpdate(version=v):
                    state.version = max(state.version, v)
            await serve_waiting()
            ctx.status.update(state.counters(), version=state.version,
                              rejected_frames=codec.rejected)
