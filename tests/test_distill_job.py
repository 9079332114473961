"""On-policy distillation as a whole job: a tiny random student learns toward a tiny teacher.

The teacher is a tiny llama trained to say ``a`` after any context (``build_peaked_model``); the
student (another seed, the same tokenizer) samples, the teacher pool scores its tokens, and the
learner trains on the distillation advantage alone (``teacher.task_rewards = false``) for 20
steps. Checked on the run's recording and metrics:

- every recorded sample carries the teacher's log-probs of its own tokens, equal to the
  teacher's forward on the recorded ids (through the router, the wire, the recording);
- ``rerun --step`` reproduces a step exactly from the checkpoint before it;
- the per-token reverse KL to the teacher (``distill/reverse_kl/mean``) falls.

And a teacher worker killed while it holds requests (frozen with SIGSTOP while the sampler's
requests reach it, then SIGKILLed) is restarted and the router re-sends what it held: every
step comes, no group is dropped for want of its teacher.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from actors.offline.rerun import rerun
from actors.runtime.recording import decode_group, read_table
from actors.runtime.tensors import from_wire
from actors.teacher.model import TeacherModel
from tests.jobs import FAST, ROOT, actor_pids, balanced, command, metrics, pids_of, status_lines
from tests.tiny_model import build_peaked_model, build_tiny_model

STEPS = 20


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("distill")
    student = build_tiny_model(base / "student", seed=0)
    teacher = build_peaked_model(base / "teacher")
    run = base / "run"
    res = subprocess.run(
        command(student, run, f"learner.total_steps={STEPS}", "learner.save_every=10",
                f"teacher.path={teacher}", "teacher.task_rewards=false"),
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "teacher×1" in res.stdout and "| teacher kl " in res.stdout  # the step lines show it
    return run, teacher


def test_recorded_samples_carry_the_teachers_logprobs_of_their_tokens(job):
    run, teacher_path = job
    teacher = TeacherModel(teacher_path, device="cpu", dtype="auto", model_dtype="float32",
                           threads=1, batch_size=16)
    teacher.load()
    groups = [decode_group(m) for m in read_table(run, "groups").column("message").to_pylist()]
    assert len(groups) >= STEPS * 4
    for g in groups[:6]:
        prompt = from_wire(g.prompt_ids).tolist()
        responses = [from_wire(s.response_ids).tolist() for s in g.samples]
        expected = teacher.logprobs(prompt, responses)
        for s, e in zip(g.samples, expected, strict=True):
            assert s.teacher_logprobs is not None
            got = from_wire(s.teacher_logprobs)
            assert got.shape == e.shape and torch.allclose(got, e, rtol=0, atol=1e-5)
        assert g.teacher_seconds > 0
    assert all(s.teacher_logprobs is not None for g in groups for s in g.samples)


def test_rerun_of_a_distillation_step_is_exact(job):
    run, _ = job
    out = io.StringIO()
    assert rerun(run, 12, out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "rerun step 11 on the way: match" in text and "result: match — all" in text
    assert "distill/reverse_kl/mean" in text and "critic/advantages/mean" in text


def test_the_reverse_kl_to_the_teacher_falls(job):
    run, _ = job
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    kl = [r["distill/reverse_kl/mean"] for r in rows]
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    print(f"distill/reverse_kl/mean: first 5 {kl[:5]}, last 5 {kl[-5:]}")
    assert last < 0.7 * first, kl
    assert all(r["timing_s/teacher"] > 0 for r in rows)


# a pool worker's restart by the runner (test_chaos: a killed reward worker) and the router's
# re-send of what a dead teacher held (test_teacher), together in a job: behind -m slow (run by CI)
@pytest.mark.slow
def test_a_killed_teacher_worker_is_restarted_and_its_requests_resent(tiny_model, tmp_path):
    teacher = build_tiny_model(tmp_path / "teacher", seed=5)
    run_dir, log = tmp_path / "run", tmp_path / "runner.log"
    # steps enough after the kill that the router reports its re-send before the job ends
    cmd = command(tiny_model, run_dir, *FAST, "learner.total_steps=20", f"teacher.path={teacher}")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(metrics(run_dir)) < 1:  # the job is running and the teacher serving
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        (pid,) = pids_of(run_dir, "teacher")
        os.kill(pid, signal.SIGSTOP)  # requests reach it and stay there
        seen = len(status_lines(run_dir))
        # until the router's status, recorded after the stop, shows it holding requests
        while not any(line.get("router-0", {}).get("worker/teacher-0", {}).get("in_flight")
                      for line in status_lines(run_dir)[seen:]):
            assert proc.poll() is None and time.monotonic() < deadline + 120, \
                log.read_text()[-4000:]
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()[-4000:]
    status = status_lines(run_dir)
    (exited,) = [line for line in status if line["event"] == "exited"]
    assert exited["actor"] == "teacher-0" and exited["returncode"] == -signal.SIGKILL
    assert exited["restart"] and status[-1]["teacher-0"]["restarts"] == 1
    assert status[-1]["router-0"]["resent"] >= 1  # what it held went to the restarted worker
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(balanced(r) for r in rows)
    assert rows[-1]["replay/dropped_score_failed"] == 0
    assert not actor_pids(run_dir)
