"""A sampler leaving a running job (``actors/sampler/leaving.py``) against the real replay buffer
actor, in this process over real ipc sockets: what it drained is accepted once, what it held is
handed back and issued to another sampler first, and the counters balance."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import zmq

from actors.replay.actor import replay_actor
from actors.runtime.actor import serve_actor
from actors.runtime.zmq_bridge import AsyncSocket, make_socket
from actors.sampler.leaving import Holdings
from messages.codec import Codec, encode
from messages.rollout import FromReplay, GroupsDone, Prompt, PromptBatch, PromptRequest
from tests.helpers import actor_context, live_topology, sample_group, wait_for


async def ask(sock: AsyncSocket, count: int, incarnation: str) -> PromptBatch:
    await sock.send_multipart([encode(PromptRequest(count, incarnation))])
    batch = Codec(FromReplay).decode((await sock.recv_multipart())[-1])
    assert isinstance(batch, PromptBatch)
    return batch


def group_for(prompt: Prompt):
    return msgspec.structs.replace(sample_group(), prompt=prompt)


def balanced(status: dict) -> bool:
    return status["issued"] == status["trained"] + status["dropped"] + status["in_flight"]


@pytest.mark.anyio
@pytest.mark.parametrize("finish", [0, 1, 3])
async def test_a_leaving_sampler_hands_back_what_it_holds_and_nothing_twice(sockets, finish):
    """It takes 3 prompts and finishes ``finish`` of them within its grace; the rest go to the
    next sampler that asks, a group it sends after leaving is refused, nothing is lost."""
    topo = live_topology(sockets, "replay.capacity=64")
    zctx = zmq.Context()
    ctx = actor_context("replay", topo, zctx)
    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                await tg.start(serve_actor, ctx, replay_actor, None)
                with make_socket(zctx, zmq.DEALER, connect=topo.replay.address,
                                 identity=b"leaving") as sock, \
                        make_socket(zctx, zmq.DEALER, connect=topo.replay.address,
                                    identity=b"staying") as other:
                    holdings = Holdings(sock, "inc-1", grace_s=0.5)
                    batch = await holdings.take(lambda: ask(sock, 3, "inc-1"))
                    assert batch is not None and len(batch.prompts) == 3
                    done = [group_for(p) for p in batch.prompts[:finish]]
                    draining = anyio.Event()
                    async with anyio.create_task_group() as work:  # the sampler's work
                        work.start_soon(holdings.drain, draining, work.cancel_scope)
                        draining.set()
                        if done:  # finished within the grace: sent, no longer held
                            await sock.send_multipart([encode(GroupsDone(done))])
                            holdings.gave(done)
                        await anyio.sleep_forever()  # until the drain ends the work
                    assert holdings.draining
                    assert await holdings.take(lambda: ask(sock, 3, "inc-1")) is None
                    unfinished, requeued = await holdings.leave()
                    held = [p.prompt_id for p in batch.prompts[finish:]]
                    assert unfinished == held and requeued == len(held)
                    if held:  # issued again, first, to the next sampler asking
                        again = await ask(other, 3, "inc-2")
                        assert [p.prompt_id for p in again.prompts[:len(held)]] == held
                        # two copies of one group (a leaver's late one, which its drain never
                        # sends, and the new holder's): the first is taken, the second refused
                        late = GroupsDone([group_for(again.prompts[0])])
                        await sock.send_multipart([encode(late)])
                        await other.send_multipart([encode(late)])
                        await wait_for("a copy refused", lambda: ctx.status.get("rejected") == 1)
                await wait_for("the leave counted", lambda: ctx.status.get("samplers_left") == 1)
                status = dict(ctx.status)
                assert status["handed_back"] == len(held) and balanced(status)
                # each finished group accepted once
                assert status["held"] == finish + (1 if held else 0)
                tg.cancel_scope.cancel()
    finally:
        zctx.destroy(linger=0)
