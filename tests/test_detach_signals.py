"""A worker attached by hand (``runner.py attach``) leaves with status 0 whenever its stop signal
comes: before it serves, while it drains, and while its process exits. Each case keeps sending
SIGTERM, a hundred a second, from its moment until the process is gone, so an instant at which a
signal could still kill the process (the interpreter's teardown, seconds long, restores the
default handlers) is hit. A real router runs in this process; the worker is a real ``runner.py attach
reward`` process with a scoring function slow enough to hold a request through the drain, and
the request it holds is answered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import anyio
import pytest
import zmq

from actors.router.actor import router_actor
from actors.runtime.actor import serve_actor
from actors.runtime.zmq_bridge import make_socket
from tests.helpers import actor_context, live_topology, routed, score_request, wait_for
from tests.jobs import ROOT
from tests.test_reward_worker import SLOW_FUNCTION, reply_to, worker_entry


async def signal_until_gone(worker: anyio.abc.Process) -> int:
    """SIGTERM every 10 ms until ``worker`` has exited; its exit status."""
    while worker.returncode is None:
        try:
            os.kill(worker.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        await anyio.sleep(0.01)
    return await worker.wait()


class Output:
    """The worker's output, line by line, with an event per awaited line (set at the end of
    the output too: a worker that ended without the line fails the wait, naming it)."""

    def __init__(self, *awaited: str) -> None:
        self.lines: list[str] = []
        self.seen = {text: anyio.Event() for text in awaited}

    async def wait_line(self, text: str) -> None:
        await self.seen[text].wait()
        assert any(text in line for line in self.lines), f"no {text!r} in:\n{self}"

    async def read(self, worker: anyio.abc.Process) -> None:
        assert worker.stdout is not None
        pending = b""
        async for chunk in worker.stdout:
            pending += chunk
            *done, pending = pending.split(b"\n")
            for line in done:
                self.lines.append(line.decode())
                for text, event in self.seen.items():
                    if text in self.lines[-1]:
                        event.set()
        for event in self.seen.values():
            event.set()

    def __str__(self) -> str:
        return "\n".join(self.lines[-40:])


@pytest.mark.anyio
@pytest.mark.parametrize("moment", ["before serving", "draining", "exiting"])
async def test_an_attached_worker_detaches_with_status_0_whenever_the_signal_comes(
        tmp_path, sockets, moment):
    scorer = tmp_path / "scorer.py"
    scorer.write_text(SLOW_FUNCTION)
    topo = live_topology(sockets)
    zctx = zmq.Context()
    router_ctx = actor_context("router", topo, zctx, tmp_path)
    out = Output("attaching to the job", "detached:")
    try:
        with anyio.fail_after(120):  # a bound on a wait; each case takes seconds
            async with anyio.create_task_group() as tg:
                await tg.start(serve_actor, router_ctx, router_actor, None)
                worker = await anyio.open_process(
                    [sys.executable, str(ROOT / "runner.py"), "attach", "reward", "--to",
                     topo.router.worker_address, f'reward.functions=[{{path="{scorer}"}}]',
                     "reward.timeout_s=30"],
                    cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                tg.start_soon(out.read, worker)
                name = f"reward-attached-{worker.pid}"
                with make_socket(zctx, zmq.DEALER, connect=topo.router.address) as client:
                    await out.wait_line("attaching to the job")  # stop signals held from here
                    if moment == "before serving":
                        status = await signal_until_gone(worker)
                    else:
                        await wait_for("the worker at the router",
                                       lambda: worker_entry(router_ctx, name) != {}, 60)
                        await client.send_multipart(routed(7, score_request(
                            "2", data_source="mine", ground_truth="x")))
                        await wait_for("a request in flight at the worker",
                                       lambda: worker_entry(router_ctx, name).get("in_flight") == 1,
                                       30)
                        if moment == "draining":
                            status = await signal_until_gone(worker)
                        else:  # the drain ends on its own; the signals come as it exits
                            worker.send_signal(signal.SIGTERM)
                            await out.wait_line("detached:")
                            status = await signal_until_gone(worker)
                        reply = await reply_to(client, 7)  # the request it held is answered
                        assert [r.score for r in reply.results] == [1.0]
                assert status == 0, str(out)
                tg.cancel_scope.cancel()
    finally:
        zctx.destroy(linger=0)
    assert "Traceback" not in str(out), str(out)
    if moment != "before serving":
        assert any("detached: 1 requests done" in line for line in out.lines), str(out)
