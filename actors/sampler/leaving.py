"""What a sampler holds, and how it leaves a running job without losing or doubling a prompt.

A sampler holds a prompt from the moment the replay buffer's batch reaches it until the group of
that prompt is sent back (``took`` / ``gave``). Asked to leave (a detach, or a spot machine's
notice: ``ActorContext.draining``), it stops asking for prompts, lets the held ones finish for at
most ``sampler.drain_grace_s`` seconds, ends its work, and sends ``SamplerLeaving`` as its last
message to the buffer. The buffer's own record decides what comes back: every prompt it issued to
this sampler without a group back (a batch still on its way included) is issued again to the
others. Groups sent before ``SamplerLeaving`` travel ahead of it on the same connection, so they
are accepted; the work is cancelled before it is sent, so no group can follow it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from actors.runtime.zmq_bridge import AsyncSocket
from messages.codec import Codec, DecodeError, encode
from messages.rollout import FromReplay, LeaveAck, PromptBatch, SamplerLeaving, ScoredGroup

LEAVE_ACK_S = 5.0  # how long a leaving sampler waits for the replay buffer's LeaveAck


class Holdings:
    """The prompt ids a sampler holds; its drain and its goodbye to the replay buffer."""

    def __init__(self, replay: AsyncSocket, incarnation: str, grace_s: float) -> None:
        self.replay, self.incarnation, self.grace_s = replay, incarnation, grace_s
        self.codec: Codec[FromReplay] = Codec(FromReplay)
        self.holding: set[int] = set()  # prompt ids taken and no group sent for them yet
        self.emptied = anyio.Event()  # set when ``holding`` becomes empty (replaced on a take)
        self.draining = False  # asked to leave: no more prompts are taken
        self.intake: anyio.CancelScope | None = None  # a wait for prompts, cancelled by a drain

    def took(self, batch: PromptBatch) -> None:
        if not self.holding:
            self.emptied = anyio.Event()
        self.holding.update(p.prompt_id for p in batch.prompts)

    def gave(self, groups: list[ScoredGroup]) -> None:
        """Groups are sent: their prompts are no longer this sampler's."""
        self.holding.difference_update(g.prompt.prompt_id for g in groups)
        if not self.holding:
            self.emptied.set()

    async def take(self, ask: Callable[[], Awaitable[PromptBatch]]) -> PromptBatch | None:
        """``await ask()``'s batch, held from now; None once the sampler drains (the wait is
        cancelled then, and a batch that came anyway is left to the buffer to issue again)."""
        with anyio.CancelScope() as self.intake:
            if not self.draining:
                batch = await ask()
                self.took(batch)
                return None if self.draining else batch
        return None

    async def drain(self, draining: anyio.Event, work: anyio.CancelScope) -> None:
        """Once asked to leave: take no more prompts, let the held ones finish for at most
        ``grace_s``, then cancel ``work`` (what is unfinished is handed back by ``leave``)."""
        await draining.wait()
        self.draining = True
        if self.intake is not None:
            self.intake.cancel()
        with anyio.move_on_after(self.grace_s):
            while self.holding:
                await self.emptied.wait()
        work.cancel()

    async def leave(self) -> tuple[list[int], int | None]:
        """Send ``SamplerLeaving`` and wait for the buffer's answer: the prompt ids unfinished
        here, and how many the buffer issues again (None: it did not answer in time; then its
        ``replay.sampler_timeout_s`` takes them back)."""
        unfinished = sorted(self.holding)
        await self.replay.send_multipart([encode(SamplerLeaving(self.incarnation, unfinished))])
        with anyio.move_on_after(LEAVE_ACK_S):
            while True:
                frames = await self.replay.recv_multipart()
                try:
                    msg = self.codec.decode(frames[-1])
                except DecodeError:
                    continue
                if isinstance(msg, LeaveAck):  # (a batch sent before it is skipped)
                    return unfinished, msg.requeued
        return unfinished, None
