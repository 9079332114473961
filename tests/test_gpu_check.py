"""``bench/gpu_check.py --dry-run``: the GPU check's every row on the CPU with tiny shapes, so the
script a GPU machine runs cannot rot (about 4 minutes on 2 cores: the job row's two runner
starts, and the benches the speed rows run, each on the thin or a small model)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from tests.jobs import ROOT


@pytest.mark.slow  # minutes: behind -m slow to keep the fast suite near 12 minutes
def test_the_gpu_check_runs_every_row_on_the_cpu(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--json", str(out),
                           "--workdir", str(tmp_path / "work")], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["check"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["kernels", "logprobs H=32", "hf parity", "hf parity (inductor)",
                          "hf tokens", "decode graphs", "local step", "ipc colocated",
                          "nccl 2 GPUs", "sleep lending", "learner step", "offload", "job",
                          "learner mfu", "bench_decode", "trl", "update"]
    # sleep lending needs vLLM's sleep mode, which its CPU build lacks: skipped, saying why
    assert rows.pop("sleep lending")["status"] == "skip"
    trl = rows.pop("trl")  # TRL is the bench extra: without it the flowrl side runs alone
    if all(importlib.util.find_spec(m) for m in ("trl", "datasets")):
        assert trl["status"] == "ok", trl
        assert re.search(r"flowrl [\d.]+ samples/s, TRL [\d.]+", trl["detail"])
    else:
        assert trl["status"] == "skip", trl
        assert re.search(r"TRL not installed .*flowrl [\d.]+ samples/s alone", trl["detail"])
    assert all(r["status"] == "ok" for r in rows.values()), rows
    assert "each load holds its version" in rows["ipc colocated"]["detail"]
    assert "each load holds its version" in rows["nccl 2 GPUs"]["detail"]
    assert "max" in rows["hf parity"]["detail"] and "tokens/s" in rows["learner step"]["detail"]
    assert "steps recorded [1, 2]" in rows["job"]["detail"]
    assert "tokens/s" in rows["hf tokens"]["detail"]
    assert "static caches made 1" in rows["decode graphs"]["detail"]
    assert "same yes" in rows["local step"]["detail"] and "freed yes" in rows["local step"]["detail"]
    assert "ops per step" in rows["bench_decode"]["detail"]
    assert "job / alone" in rows["update"]["detail"]
    assert "check" in done.stdout and "status" in done.stdout  # the one table, printed


def test_an_unknown_row_is_refused():
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--only", "kernelz"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "kernelz" in done.stderr
