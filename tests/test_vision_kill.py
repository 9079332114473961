"""A sampler of a vision-language job killed with SIGKILL mid-run loses no image: the runner
restarts it, the prompts it held are issued again with their images (the replay buffer keeps
an issued prompt's images until its group comes back), and every group the learner trained on
was recorded with the image its prompt was issued with."""

from __future__ import annotations

import subprocess

import pytest

from actors.runtime.recording import decode_group, read_table
from tests.jobs import ROOT, actor_pids, balanced, command, kill_the_sampler, metrics
from tests.test_vision_job import JOB, colour_data

STEPS = 8


@pytest.mark.slow  # a VLM job with a restart: about a minute on 2 cores
def test_a_killed_sampler_of_a_vlm_job_loses_no_image(tiny_vlm, tmp_path):
    data = colour_data(tmp_path / "data", images=True)
    run_dir = tmp_path / "run"
    job = [a for a in JOB if not a.startswith("learner.total_steps=")]
    proc = subprocess.Popen(command(tiny_vlm, run_dir, *job, f"learner.total_steps={STEPS}",
                                    f"task.datasets=[{{path='{data}'}}]",
                                    f"reward.functions=[{{path='{data.parent / 'reward.py'}'}}]"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_the_sampler(run_dir, proc, after_steps=2, timeout=600)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and all(balanced(r) for r in rows)

    # every trained group holds its prompt's image: the colour its ground truth names
    pictures = {c: (data.parent / f"{c}.png").read_bytes() for c in ("red", "blue")}
    groups = {r["group_id"]: decode_group(r["message"])
              for r in read_table(run_dir, "groups").to_pylist()}
    trained = [f["group_id"] for f in read_table(run_dir, "fates").to_pylist()
               if f["fate"] == "trained"]
    assert len(trained) == STEPS * 4
    for gid in trained:
        prompt = groups[gid].prompt
        assert prompt.images == [pictures[prompt.ground_truth]], (gid, prompt.ground_truth)
    assert not actor_pids(run_dir)
