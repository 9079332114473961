"""GPU memory a sleeping vLLM engine lends the learner on its GPU, through the
host's table: the exchange between two processes, the engine's wake waiting for the learner's
step to give the memory back, and a learner that only fits on lent memory failing loudly.

The learner's allocator is a recording stand-in here (``set_per_process_memory_fraction`` needs
a GPU): what it records is the cap the learner would hold at each moment. vLLM's sleep mode does
not exist on a CPU, so the engine's side runs against ``test_vllm_sleep.RecordingLLM``; the GPU
run of the whole exchange is ``bench/gpu_check.py``'s ``sleep lending`` row."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path

import anyio
import pytest
import trio

from actors.runtime.cores import CoreTable, table_path
from actors.runtime.memory_lending import (
    MIB,
    MemoryBorrower,
    MemoryLender,
    holder_slot,
    holders_among,
    lender_slot,
    lenders_among,
)
from actors.sampler.engines.vllm.engine import VLLMEngine, VLLMSettings
from tests.test_vllm_sleep import RecordingLLM

OWN = 0.45  # each of the two processes' share of their GPU


class Allocator:
    """Records the caps the learner's allocator is given; ``holds``: what it keeps after a
    step (its own state)."""

    def __init__(self, total: int = 1000 * MIB, holds: int = 0, caps=None) -> None:
        self.total, self.holds = total, holds
        self.caps = [] if caps is None else caps

    def cap(self, share: float) -> None:
        self.caps.append(round(share, 4))

    def held(self) -> int:
        return self.holds


def learner(path: str, caps, lent, in_step, finish, done) -> None:
    """A learner rank in its own process: one step on what is lent, held until ``finish``."""
    borrower = MemoryBorrower(CoreTable(Path(path)), holder_slot(0), [lender_slot(0)], OWN,
                              Allocator(caps=caps))
    lent.wait()
    with borrower.step() as mib:
        caps.append(mib)
        in_step.set()
        finish.wait()
    done.set()
    borrower.close()


def test_the_learner_holds_lent_memory_for_its_step_and_the_sampler_waits_for_it(tmp_path):
    path = table_path(tmp_path)
    lender = MemoryLender(CoreTable(path), lender_slot(0), [holder_slot(0)])
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        caps = manager.list()
        lent, in_step, finish, done = (ctx.Event() for _ in range(4))
        child = ctx.Process(target=learner, args=(str(path), caps, lent, in_step, finish, done))
        child.start()
        try:
            lender.lend(300 * MIB)  # the engine fell asleep, freeing 300 MiB
            lent.set()
            assert in_step.wait(60)
            assert not lender.take_back()  # the learner holds it: the engine must not wake
            finish.set()
            assert done.wait(60)
            assert lender.take_back()  # given back at the end of the step
            assert list(caps) == [0.75, 300, 0.45]  # own + 300 of 1000 MiB; back to its own
        finally:
            child.join(60)
            lender.close()
    assert child.exitcode == 0


def test_memory_taken_back_before_the_step_is_not_borrowed(tmp_path):
    path = table_path(tmp_path)
    lender = MemoryLender(CoreTable(path), lender_slot(3), [holder_slot(0)])
    memory = Allocator()
    borrower = MemoryBorrower(CoreTable(path), holder_slot(0), [lender_slot(3)], OWN, memory)
    try:
        lender.lend(200 * MIB)
        assert lender.take_back()  # the engine wakes before the learner's next step
        with borrower.step() as mib:
            assert mib == 0
        assert memory.caps == []  # its cap never moved
        lender.lend(2000 * MIB)  # more than a lender's share of the GPU is never borrowed
        with borrower.step():
            pass
        assert memory.caps == [0.9, 0.45] and borrower.borrowed_steps == 1
    finally:
        lender.close()
        borrower.close()


def test_a_learner_that_only_fits_on_lent_memory_fails_after_giving_it_back(tmp_path):
    path = table_path(tmp_path)
    lender = MemoryLender(CoreTable(path), lender_slot(0), [holder_slot(0)])
    memory = Allocator(holds=600 * MIB)  # its state grew past its own 450 MiB while borrowing
    borrower = MemoryBorrower(CoreTable(path), holder_slot(0), [lender_slot(0)], OWN, memory)
    try:
        lender.lend(400 * MIB)
        with pytest.raises(MemoryError, match="fits only while the sampler sleeps"):
            with borrower.step():
                pass
        assert lender.take_back()  # the sampler can wake: the job fails, never hangs
    finally:
        lender.close()
        borrower.close()


def test_placement_names_map_to_slots():
    assert lenders_among(["learner-0", "sampler-2", "teacher-0"]) == [lender_slot(2)]
    assert holders_among(["sampler-1", "learner-0", "learner-0.rank3"]) == [holder_slot(0),
                                                                             holder_slot(3)]


@pytest.mark.anyio
async def test_a_sleeping_engine_lends_what_it_freed_and_wakes_once_it_is_given_back(tmp_path):
    path = table_path(tmp_path)
    lender = MemoryLender(CoreTable(path), lender_slot(0), [holder_slot(0)])
    memory = Allocator(total=100 * MIB)
    borrower = MemoryBorrower(CoreTable(path), holder_slot(0), [lender_slot(0)], OWN, memory)
    refused = threading.Event()  # the waking engine found the memory still held
    take_back = lender.take_back

    def observed_take_back() -> bool:
        given = take_back()
        if not given:
            refused.set()
        return given

    lender.take_back = observed_take_back  # type: ignore[method-assign]
    engine = VLLMEngine(Path("unused"), "float32", 0,
                        VLLMSettings({}, sleep_idle_s=0.2, memory=lender))
    llm = engine.llm = RecordingLLM()

    async def start() -> None:
        engine.sleep.start(llm, lambda: engine.running)

    async def asleep() -> None:
        await llm.asleep.wait()

    try:
        await engine.loop.call(start())
        with trio.fail_after(30):
            await engine.loop.call(asleep())
            while borrower.table.slots[lender_slot(0)] == 0:  # lent right after the sleep call
                await engine.loop.call(asyncio_checkpoint())
            async with anyio.create_task_group() as tg:
                with borrower.step() as mib:
                    assert mib == 4  # RecordingLLM: 1 MiB free awake, 5 MiB asleep
                    tg.start_soon(engine.loop.call, engine.sleep.wake(llm))  # a request comes
                    await anyio.to_thread.run_sync(refused.wait)
                    assert "wake" not in llm.calls  # not while the learner holds the memory
                # the step ended: the memory is given back, and the engine wakes
        assert llm.calls == ["sleep1", "wake"] and not engine.sleep.asleep
        assert memory.caps == [0.49, 0.45]
    finally:
        await engine.aclose()
        borrower.close()


async def asyncio_checkpoint() -> None:
    """One turn of the engine's asyncio loop (its sleeper lends right after it slept)."""
    import asyncio

    await asyncio.sleep(0)
