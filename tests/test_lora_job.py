"""A whole LoRA job through ``runner.py`` on the tiny model: the learner publishes adapters, the
sampler applies every version (its behaviour log-probs are the learner's: importance weights of
1), checkpoints are PEFT adapters, ``rerun --step`` rebuilds a step from one, ``validate`` runs one,
and the run resumes from its last."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from safetensors.torch import load_file

from tests.jobs import ROOT, actor_pids, command, metrics, status_lines

LORA = ["learner.lora.rank=8", "learner.lr=2e-2", "learner.save_every=3",
        "algorithm.max_staleness=0"]  # on-policy: every behaviour log-prob is the current policy's


def test_a_lora_job_publishes_adapters_reruns_and_resumes(tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    res = subprocess.run(command(tiny_model, run_dir, "learner.total_steps=6", *LORA), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    # the sampler applied the adapters: its log-probs are the learner's recomputation with them
    # (a sampler on the base would drift from the trained policy step by step)
    assert all(r["staleness/max"] == 0 for r in rows)
    assert all(abs(r["rollout_corr/kl"]) < 1e-5 for r in rows), [r["rollout_corr/kl"] for r in rows]
    sampler = [line for line in status_lines(run_dir) if "sampler-0" in line][-1]["sampler-0"]
    # at least the version of step 6's batch (on-policy: 5); 6 itself may come after the stop
    assert sampler["version"] >= 5 and not sampler.get("weights_error"), sampler
    ckpt = run_dir / "checkpoints" / "step_6"
    assert not (ckpt / "model.safetensors").exists()
    adapter = load_file(ckpt / "adapter_model.safetensors")  # it moved: lora_B starts at 0
    assert max(float(t.abs().max()) for n, t in adapter.items() if "lora_B" in n) > 1e-2
    assert not actor_pids(run_dir)

    from actors.offline.rerun import rerun
    report = io.StringIO()
    assert rerun(run_dir, 4, out=report) == 0, report.getvalue()[-3000:]
    assert "step_3" in report.getvalue()

    # validate merges the adapter checkpoint into its base for the engine
    out = tmp_path / "val.json"
    res = subprocess.run([sys.executable, "runner.py", "validate", str(run_dir), "--checkpoint",
                          "step_6", "validation.n=2", "--out", str(out),
                          'validation.datasets=[{builtin="repeat_letter", size=2}]'],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads(out.read_text())["step"] == 6
    assert json.loads(out.read_text())["metrics"]["val-aux/samples"] == 4

    res = subprocess.run(command(tiny_model, run_dir, "learner.total_steps=8", *LORA), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert [r["step"] for r in metrics(run_dir)][6:] == [7, 8]
    assert status_lines(run_dir)[-1]["learner-0"]["resumed_from"] == "step_6"
    assert not actor_pids(run_dir)
