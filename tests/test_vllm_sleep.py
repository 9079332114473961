"""``sampler.sleep_idle_s``: a vLLM engine on a GPU shared with the learner sleeps once idle and
wakes for the next request or weights load. vLLM's CPU build has no sleep mode
(``Platform.is_sleep_mode_available`` is false for the CPU in vLLM 0.32: the engine refuses
``enable_sleep_mode``), so the engine's control flow runs here against a stand-in that records
the AsyncLLM calls it would make; the policy itself is pure state with an explicit clock."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import trio

from actors.job.config.load import apply_overrides, decode_topology
from actors.runtime.config import ConfigError, vllm_problem
from actors.sampler.engines.vllm.engine import VLLMEngine, VLLMSettings
from actors.sampler.engines.vllm.sleep import SleepPolicy


def test_the_policy_sleeps_only_after_the_idle_time_and_wakes_for_work():
    p = SleepPolicy(5.0)
    assert not p.due(100.0)  # busy from the start until told idle
    p.idle(100.0)
    assert not p.due(104.9) and p.due(105.0)
    p.slept()
    assert not p.due(200.0)  # asleep: nothing more to do
    assert p.busy() is True  # a request comes: wake first
    p.woke()
    assert p.busy() is False and not p.due(1e9)  # busy again: never due
    assert not SleepPolicy(0.0).due(1e9)  # 0: never sleeps


class RecordingLLM:
    """Stands in for AsyncLLM's sleep/wake_up (no sleep mode on a CPU)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.asleep = asyncio.Event()

    async def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep{level}")
        self.asleep.set()

    async def wake_up(self) -> bool:
        self.calls.append("wake")
        return True

    async def collective_rpc(self, method: str) -> list[int]:
        """``flowrl_free_memory`` of the worker extension: 1 MiB free awake, 5 MiB asleep."""
        assert method == "flowrl_free_memory"
        return [(5 if self.asleep.is_set() and self.calls[-1] != "wake" else 1) * 2**20]

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.mark.anyio
async def test_an_idle_engine_sleeps_and_the_next_work_wakes_it():
    engine = VLLMEngine(Path("unused"), "float32", 0, VLLMSettings({}, sleep_idle_s=0.2))
    llm = engine.llm = RecordingLLM()

    async def start() -> None:  # what _start does after the engine is up
        engine.sleep.start(llm, lambda: engine.running)

    async def asleep() -> None:
        await llm.asleep.wait()

    try:
        await engine.loop.call(start())
        with trio.fail_after(30):
            await engine.loop.call(asleep())
        assert engine.sleep.asleep and engine.sleep.clock.sleeps == 1
        await engine.loop.call(engine.sleep.wake(llm))  # a request or a load comes
        assert llm.calls == ["sleep1", "wake"] and not engine.sleep.asleep
        await engine.loop.call(engine.sleep.wake(llm))  # awake already: nothing to do
        assert llm.calls == ["sleep1", "wake"]
        assert engine.statistics()["sleeps"] == 1
        assert engine.statistics()["freed_mb"] == 4.0  # the free bytes' rise over the sleep
        assert engine.statistics()["wake_ms"] >= 0 and engine.statistics()["asleep"] == "false"
    finally:
        await engine.aclose()
    assert llm.calls[-1] == "shutdown"


@pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))
@pytest.mark.parametrize(("extra", "why"), [
    (["sampler.engine=hf"], "needs sampler.engine = vllm"),
    (["sampler.engine=vllm", "sampler.device=cpu"], "no sleep mode on a CPU"),
])
def test_sleeping_needs_vllm_on_a_gpu(extra, why):
    with pytest.raises(ConfigError, match=f"sampler.sleep_idle_s: .*{why}"):
        decode_topology(apply_overrides({}, ["sampler.sleep_idle_s=5", *extra]))
