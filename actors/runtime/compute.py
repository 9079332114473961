"""Blocking compute (a generation, a training step) run beside an actor's event loop.

Its own module, free of the config and the actor lifecycle: the engines use it, and an engine's
code never imports the config's package (the config's rows load the engines).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel


async def run_compute(fn: Callable[..., Any], *args: Any, abort: threading.Event) -> Any:
    """Run blocking compute in a worker thread so the event loop keeps serving.

    The thread cannot be interrupted, so on cancellation ``abort`` is set (the compute checks it
    between tokens or micro-batches and returns early) and the cancellation is delivered once
    the thread has returned: no thread is left touching the model after this returns. A result
    the thread finished while the caller was being cancelled is discarded with the cancellation,
    so whatever must not be lost with it (a step's metrics line) is written inside ``fn``.
    """
    finished = False

    async def watch() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            if not finished:
                abort.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            return await anyio.to_thread.run_sync(fn, *args)
        except Exception:
            if abort.is_set():  # fn gave up because we are cancelled: that is the outcome
                await anyio.lowlevel.checkpoint()
            raise
        finally:
            finished = True
            tg.cancel_scope.cancel()
