"""Slow tests (``-m slow``, run by CI after the fast suite): the real default job learns."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.jobs import ROOT, balanced, metrics, status_lines, validations


@pytest.mark.slow
def test_the_default_job_learns_on_the_embedded_model(tmp_path):
    """``python runner.py topology.toml`` as the README runs it: 30 steps of GRPO on the
    embedded SmolLM2-135M-Instruct, on a CPU with the transformers engine (``sampler.engine =
    "auto"`` picks vLLM only with a GPU), validating at steps 0, 10, 20 and 30 (its figures:
    BENCHMARKS.md, "The default job learning on 2 CPU cores")."""
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "runner.py", "topology.toml", f"run.dir={run_dir}",
                          "run.status_interval=0"], cwd=ROOT, capture_output=True, text=True,
                         timeout=3600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    rewards = [r["critic/score/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"\ndefault job: reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.3, f"reward did not clearly rise: {first:.3f} -> {last:.3f}"
    assert all(balanced(r) for r in rows)
    assert status_lines(run_dir)[-1]["outcome"] == "finished"
    rounds = validations(run_dir)
    assert [v["step"] for v in rounds] == [0, 10, 20, 30]
    core = [v["val-core/arithmetic/reward/mean@4"] for v in rounds]
    print(f"validation mean@4 at steps 0, 10, 20, 30: {core}")
    assert core[-1] > core[0] + 0.2, f"validation did not clearly rise: {core}"
