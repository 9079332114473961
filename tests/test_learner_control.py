"""Control messages between the learner's ranks do not ride a collective that times out: a
follower waits for rank 0's next message longer than ``learner.collective_timeout_s`` (a small
one here, on gloo) and still gets it, and the ranks' collectives go on afterwards."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from actors.runtime.ranks import Rank, free_port

TIMEOUT_S = 1.0  # learner.collective_timeout_s of the group
WAIT_S = 3.0  # rank 0 is busy this long before its next message (vLLM start, a checkpoint...)


def _rank(rank: int, port: int, results) -> None:
    import torch

    from actors.learner.distributed import Group

    torch.set_num_threads(1)
    me = Rank(rank=rank, world_size=2, local_rank=rank, local_world_size=2, node_rank=0,
              master_addr="127.0.0.1", master_port=port)
    group = Group.join(me, torch.device("cpu"), timeout_s=TIMEOUT_S)
    try:
        if group.leader:
            time.sleep(WAIT_S)  # the point of the test: longer than the collective timeout
            got = group.broadcast_control(b"step 1")
        else:
            got = group.broadcast_control(None)
        total = group.sum_floats([1.0])  # a collective of the group still works after
        results.put((rank, got, total))
    except Exception as exc:  # the follower's gloo timeout, before the fix
        results.put((rank, repr(exc), None))
    finally:
        group.close()


def test_a_follower_outwaits_the_collective_timeout_for_rank_0s_message():
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict((r, (msg, total)) for r, msg, total in (results.get(timeout=120)
                                                           for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got == {0: (b"step 1", [2.0]), 1: (b"step 1", [2.0])}, got


@pytest.mark.parametrize("world", [1])
def test_a_lone_rank_has_no_control_group(world):
    import torch

    from actors.learner.distributed import Group

    lone = Group.lone(torch.device("cpu"))
    assert lone.control is None and lone.broadcast_control(b"x") == b"x"
