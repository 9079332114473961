"""Offline tools on a real recorded run: a 6-step tiny-model job with a checkpoint at step 3.

``rerun --step`` must reproduce recorded steps exactly, both right after a checkpoint and after
rerunning the steps on the way from one; a corrupted recording is caught at the first differing
quantity; ``--rescore`` counts changed scores; ``inspect`` prints the summary and writes PNGs.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import pytest

from actors.offline.rerun import rerun
from actors.runtime.recording import decode_group, last_by, parts, read_table
from tests.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("offline")
    model = build_tiny_model(base / "model")
    run = base / "run"
    res = subprocess.run(
        [sys.executable, "runner.py", "topology.toml", f"model.path={model}", f"run.dir={run}",
         "sampler.engine=hf", "task.name=repeat_letter", "learner.lr=3e-3", "sampler.max_tokens=8",
         "run.status_interval=0", "run.heartbeat_interval=0.5", "learner.total_steps=6",
         "learner.save_every=3", "learner.keep_checkpoints=10", "validation.every=3",
         'validation.datasets=[{builtin="repeat_letter", size=8}]'],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3", "step_6"]
    return run


def runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "runner.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def check_match(text: str, forward: list[int]) -> None:
    assert "checkpoints/step_3" in text
    for s in forward:
        assert f"rerun step {s} on the way: match" in text
    assert "result: match — all" in text
    assert "actor/grad_norm" in text and "rollout_corr/is_weight_mean" in text
    assert "not compared (about the live system" in text and "timing_s/step" in text


def test_rerun_right_after_a_checkpoint_matches_exactly(run_dir):
    out = io.StringIO()
    assert rerun(run_dir, 4, out=out) == 0, out.getvalue()
    check_match(out.getvalue(), [])


def test_the_recorded_learner_borrowed_the_samplers_idle_thread(run_dir):
    """The reruns here are exact although the live learner computed on a varying number of
    threads (the sampler's, lent while it waited: actors/runtime/cores.py)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r["perf/borrowed_share"] > 0 for r in rows), [r["perf/borrowed_share"] for r in rows]
    # each step recorded the count of every check (run-length: count, checks, ...), which the
    # rerun sets again: more than one thread where the step borrowed
    traces = {r["step"]: r["threads"] for r in read_table(run_dir, "batches").to_pylist()}
    for r in rows:
        counts = traces[r["step"]][::2]
        assert (max(counts) > 1) == (r["perf/borrowed_share"] > 0), (r, traces[r["step"]])


def test_rerun_with_forward_steps_matches_exactly(run_dir):
    res = runner("rerun", str(run_dir), "--step", "6")  # the command line, as a user runs it
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    check_match(res.stdout, [4, 5])


def test_rerun_dumps_per_token_tensors(run_dir, tmp_path):
    import torch

    gid = read_table(run_dir, "batches").to_pylist()[1]["group_ids"][0]  # step 2: base + 1 forward
    out = io.StringIO()
    assert rerun(run_dir, 2, dump=[f"{gid}:1"], dump_dir=str(tmp_path), out=out) == 0
    assert "base model" in out.getvalue()
    dump = torch.load(tmp_path / "step_2_dump.pt")
    one = dump[f"{gid}:1"]
    group = decode_group(last_by(read_table(run_dir, "groups"), "group_id")[gid]["message"])
    behav = torch.frombuffer(bytearray(group.samples[1].behaviour_logprobs.data), dtype=torch.float32)
    assert torch.equal(one["behaviour_logprobs"], behav)
    assert one["is_weights"].shape == one["advantages"].shape == behav.shape
    assert pq.read_table(tmp_path / "step_2_dump.parquet").num_rows == len(behav)


def write_part(part: Path, table) -> None:
    """``table`` in place of recording part ``part``, named as the writer names a part (its
    CRC-32 in its name: a part changed under its old name reads as damage)."""
    pq.write_table(table, part)
    part.rename(part.with_name(f"{part.name.rsplit('-', 1)[0]}-"
                               f"{zlib.crc32(part.read_bytes()):08x}.parquet"))


def rewrite_group(run: Path, gid: int, change) -> None:
    """Record group ``gid`` of ``run`` again as ``change`` makes it (a recording altered on
    purpose, for what compares recordings to find)."""
    for part in parts(run, "groups"):
        table = pq.read_table(part)
        rows = table.to_pylist()
        for row in rows:
            if row["group_id"] == gid:
                row["message"] = msgspec.msgpack.encode(change(decode_group(row["message"])))
        write_part(part, type(table).from_pylist(rows, schema=table.schema))


def test_corrupted_recording_names_the_first_difference(run_dir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    gid = read_table(copy, "batches").to_pylist()[3]["group_ids"][0]  # in step 4's batch

    def more_reward(g):
        s0 = msgspec.structs.replace(g.samples[0], reward=g.samples[0].reward + 1.0)
        return msgspec.structs.replace(g, samples=[s0, *g.samples[1:]])

    rewrite_group(copy, gid, more_reward)
    out = io.StringIO()
    assert rerun(copy, 4, out=out) == 1, out.getvalue()
    assert "MISMATCH — first differing quantity: critic/score/mean at step 4" in out.getvalue()


def test_rescore_counts_changed_scores(run_dir, tmp_path):
    fn = tmp_path / "reward.py"
    fn.write_text("def always_one(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    return 1.0\n")
    groups = last_by(read_table(run_dir, "groups"), "group_id")
    batches = last_by(read_table(run_dir, "batches"), "step")
    rewards = [r for s in (2, 3) for g in batches[s]["group_ids"] for r in groups[g]["rewards"]]
    expected = sum(r != 1.0 for r in rewards)
    res = runner("rerun", str(run_dir), "--rescore", f"{fn}:always_one", "--steps", "2:3")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"changed: {expected} of {len(rewards)} scores; errors: 0" in res.stdout
    assert "after 1.0000" in res.stdout


def test_rescore_with_a_hanging_function_ends_with_errors(run_dir, tmp_path):
    fn = tmp_path / "hang.py"
    fn.write_text("import time\n\n\ndef compute_score(data_source, solution_str, ground_truth, "
                  "extra_info=None):\n    time.sleep(600)\n")
    res = runner("rerun", str(run_dir), "--rescore", str(fn), "--limit", "1", "--timeout", "0.5")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]  # nothing was scored
    assert "errors: 8" in res.stdout and "timed out after 0.5 s" in res.stdout
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert "every one of the 8 samples failed in hang.py:compute_score" in line
    assert "timed out after 0.5 s" in line  # the first error, said where a user looks


def test_rescore_with_the_debugging_pages_lenient_py_scores_every_sample(run_dir, tmp_path):
    """docs/debugging.md's ``lenient.py``, as the page prints it."""
    page = (ROOT / "docs" / "debugging.md").read_text()
    start = page.index("$ cat lenient.py")
    body = page[page.index("\n", start) + 1:page.index("\n$ python runner.py rerun", start)]
    (tmp_path / "lenient.py").write_text(body + "\n")
    res = runner("rerun", str(run_dir), "--rescore", str(tmp_path / "lenient.py"), "--limit", "2")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "of 16 scores; errors: 0" in res.stdout


def test_inspect_prints_summary_and_writes_plots(run_dir, tmp_path):
    res = runner("inspect", str(run_dir), "--plots", str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for text in ("=== run summary", "6 recorded (1..6)", "24 trained", "best 3 samples of step 6",
                 "=== staleness"):
        assert text in res.stdout
    assert "=== validations: 3 (steps 0, 3, 6)" in res.stdout
    assert "repeat_letter mean@4" in res.stdout
    for name in ("reward", "response_length", "kl", "entropy", "importance", "validation"):
        data = (tmp_path / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 1000
    from actors.offline.inspection import core_series, recorded_validations
    series = core_series(recorded_validations(run_dir))  # what validation.png draws
    assert series["repeat_letter mean@4"]["steps"] == [0, 3, 6]


def test_inspect_shows_as_worst_only_samples_below_the_top_reward():
    from actors.offline.inspection import extremes

    def ordered(*rewards: float) -> list[tuple]:
        return sorted(((r, k) for k, r in enumerate(rewards)), key=lambda x: (-x[0], x[1]))

    assert extremes(ordered(1.0, 1.0, 1.0, 1.0, 1.0), 3) == (ordered(1.0, 1.0, 1.0), [])
    best, worst = extremes(ordered(1.0, 0.0, 1.0, 0.5, 1.0, 1.0), 3)
    assert [r for r, _ in best] == [1.0, 1.0, 1.0] and worst == [(0.0, 1), (0.5, 3)]
    assert extremes(ordered(1.0, 0.0), 3) == (ordered(1.0, 0.0), [])  # all shown as the best


def test_validate_a_checkpoint_offline(run_dir, tmp_path):
    out = tmp_path / "val.json"
    res = runner("validate", str(run_dir), "--checkpoint", "step_3", "validation.n=2",
                 "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["step"] == 3 and got["checkpoint"].endswith("checkpoints/step_3")
    m = got["metrics"]
    assert m["val-aux/prompts"] == 8 and m["val-aux/samples"] == 16
    assert 0 <= m["val-core/repeat_letter/reward/mean@2"] <= 1
    assert "val-aux/repeat_letter/reward/pass@2" in m
    assert got["recorded"]["val-aux/prompts"] == 8  # the live validation of step 3, beside it
    assert "agree in distribution, not to the digit" in res.stdout  # (not a failed rerun)
    assert len(got["samples"]) == 8 and all(len(s["completions"]) == 2 for s in got["samples"])
    # the default is the newest checkpoint; base is the model the run started from
    res = runner("validate", str(run_dir), "--checkpoint", "base", "--out", str(out),
                 'validation.datasets=[{builtin="repeat_letter", size=2}]')
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(out.read_text())["step"] == 0
    assert json.loads(out.read_text())["metrics"]["val-aux/samples"] == 8


def test_bad_input_exits_2(run_dir, tmp_path):
    (tmp_path / "r.py").write_text("def compute_score(*a):\n    return 0.0\n")
    cases = [
        (("rerun", str(tmp_path / "nope"), "--step", "1"), "no run directory"),
        (("rerun", str(tmp_path), "--step", "1"), "topology.json"),
        (("rerun", str(run_dir), "--step", "99"), "step 99 is not recorded"),
        (("rerun", str(run_dir), "--rescore", str(tmp_path / "missing.py")), "no reward file"),
        (("rerun", str(run_dir), "--rescore", f"{tmp_path / 'r.py'}:absent"),
         "defines no function 'absent'"),
        (("inspect", str(tmp_path)), "topology.json"),
        (("validate", str(run_dir), "learner.lr=1"), "only validation.* keys"),
        (("validate", str(run_dir), "validation.datasets=[]"), "no validation prompts"),
        (("validate", str(run_dir), "--checkpoint", "step_5"), "no checkpoint"),
    ]
    for args, message in cases:
        res = runner(*args)
        assert res.returncode == 2 and message in res.stderr, (args, res.stderr)


def resume(run: Path) -> subprocess.CompletedProcess:
    """The fixture's job started again on ``run``, as its user would."""
    topology = json.loads((run / "topology.json").read_text())
    return subprocess.run(
        [sys.executable, "runner.py", "topology.toml", f"model.path={topology['model']['path']}",
         f"run.dir={run}", "sampler.engine=hf", "task.name=repeat_letter", "learner.lr=3e-3",
         "sampler.max_tokens=8", "run.status_interval=0", "run.heartbeat_interval=0.5",
         "learner.total_steps=6", "learner.save_every=3", "learner.keep_checkpoints=10",
         "validation.every=3", 'validation.datasets=[{builtin="repeat_letter", size=8}]'],
        cwd=ROOT, capture_output=True, text=True, timeout=180)


def test_a_damaged_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(
        run_dir, tmp_path):
    """The newest checkpoint's weights with bytes changed on disk, and the records cut in the
    middle of a line (a kill as they were written): the run says which checkpoint is damaged
    and why, resumes from the one before, and trains every step once."""
    from actors.runtime.rundir import damage

    run = tmp_path / "run"
    shutil.copytree(run_dir, run, symlinks=True)
    weights = run / "checkpoints/step_6/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x40
    weights.write_bytes(bytes(data))
    for record in ("metrics.jsonl", "status.jsonl"):
        with (run / record).open("a") as f:
            f.write('{"step": 7, "cut')
    before = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    res = resume(run)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert ("checkpoint step_6 is damaged: model.safetensors is not what was written (its "
            "checksum differs); set aside as step_6.damaged") in res.stdout
    assert "resuming from step_3" in res.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[:3] == before[:3]
    assert all(json.loads(line) for line in (run / "status.jsonl").read_text().splitlines())
    assert damage(run / "checkpoints/step_6") is None  # written again, whole
    assert (run / "checkpoints/step_6.damaged").is_dir()
    res = runner("validate", str(run), "--checkpoint", str(run / "checkpoints/step_6.damaged"))
    assert res.returncode == 2 and "step_6.damaged is damaged: model.safetensors" in res.stderr


def test_a_run_whose_every_checkpoint_is_damaged_stops_naming_what_to_do(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, symlinks=True)
    (run / "checkpoints/step_6/trainer_state.json").unlink()
    optimizer = next((run / "checkpoints/step_3/optimizer").glob("*.distcp"))
    optimizer.write_bytes(optimizer.read_bytes()[:100])  # cut short
    res = resume(run)
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert "checkpoint step_6 is damaged: trainer_state.json is missing" in res.stdout
    assert (f"checkpoint step_3 is damaged: optimizer/{optimizer.name} holds 100 bytes where"
            in res.stdout)
    assert "no whole checkpoint is left" in res.stderr and "start a new run directory" in res.stderr


def test_a_damaged_recording_part_is_named_by_the_resume_and_the_offline_tools(run_dir, tmp_path):
    """A groups part with a changed byte: the resume refuses in one line naming the file, and
    ``rerun`` says the same (exit 2), never training on or comparing against it."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, symlinks=True)
    part = parts(run, "groups")[0]
    meta = pq.ParquetFile(part).metadata.row_group(0)
    chunk = next(meta.column(i) for i in range(meta.num_columns)  # the exact messages: a
                 if meta.column(i).path_in_schema == "message")  # page header (its statistics
    data = bytearray(part.read_bytes())  # hold the smallest and largest), then the values
    data[chunk.data_page_offset + chunk.total_compressed_size * 7 // 8] ^= 0x08
    part.write_bytes(bytes(data))
    name = f"record/groups/{part.name} is damaged"
    res = resume(run)
    assert res.returncode == 2 and name in res.stderr and "cannot resume exactly" in res.stderr
    res = runner("rerun", str(run), "--step", "4")
    assert res.returncode == 2 and name in res.stderr, res.stderr[-2000:]


def test_diff_of_a_run_and_a_changed_copy_names_the_first_token_and_metric(run_dir, tmp_path):
    """``runner.py diff``: a run against its own copy agrees (exit 0); against a copy where
    one response token of step 4's batch changed, it names that step, group, sample and token
    with both values and versions (exit 1); where only a metric of step 5 changed, that metric."""
    from actors.offline.diff import diff

    out = io.StringIO()
    assert diff(run_dir, run_dir, out=out) == 0, out.getvalue()
    assert "agree: steps 1..6" in out.getvalue()
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    gid = read_table(copy, "batches").to_pylist()[3]["group_ids"][1]  # step 4's second group
    seen = {}

    def next_token(g):
        ids = bytearray(g.samples[2].response_ids.data)
        seen["old"] = old = int.from_bytes(ids[4:8], "little")
        seen["version"] = g.samples[2].policy_version
        ids[4:8] = (old + 1).to_bytes(4, "little")  # token 1 of sample 2
        s2 = msgspec.structs.replace(g.samples[2], response_ids=msgspec.structs.replace(
            g.samples[2].response_ids, data=bytes(ids)))
        return msgspec.structs.replace(g, samples=[*g.samples[:2], s2, *g.samples[3:]])

    rewrite_group(copy, gid, next_token)
    old, version = seen["old"], seen["version"]
    out = io.StringIO()
    assert diff(run_dir, copy, out=out) == 1, out.getvalue()
    assert (f"differ first at step 4: group 1 of the batch (prompt ids {gid} / {gid}), sample "
            f"2, response token 1: {old} / {old + 1} (weights versions {version} / {version}) "
            f"(A / B)") in out.getvalue(), out.getvalue()
    res = runner("diff", str(run_dir), str(copy))  # the command line: the same, exit 1
    assert res.returncode == 1 and "differ first at step 4" in res.stdout, res.stderr[-2000:]
    assert runner("diff", str(run_dir), str(tmp_path / "nope")).returncode == 2
    other = tmp_path / "metric"
    shutil.copytree(run_dir, other)
    for part in parts(other, "metrics"):
        table = pq.read_table(part)
        rows = table.to_pylist()
        for row in rows:
            if row["step"] == 5:
                row["metrics"] = [(k, v + 1 if k == "actor/pg_loss" else v)
                                  for k, v in row["metrics"]]
        write_part(part, type(table).from_pylist(rows, schema=table.schema))
    out = io.StringIO()
    assert diff(run_dir, other, out=out) == 1
    assert "differ first at step 5: metric actor/pg_loss: " in out.getvalue(), out.getvalue()


def test_a_bundle_of_a_step_reruns_exactly_in_another_directory(run_dir, tmp_path):
    """``runner.py bundle RUN --step 5 -o FILE``: one file that ``rerun FILE`` reruns exactly
    from anywhere, the run directory itself gone."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    out = tmp_path / "step5.tar"
    res = runner("bundle", str(copy), "--step", "5", "-o", str(out))
    assert res.returncode == 0 and f"wrote {out}" in res.stdout, res.stderr[-2000:]
    with tarfile.open(out) as tar:  # its parts carry their CRC-32, as a run's own do
        named = [m.name for m in tar.getmembers() if m.name.endswith(".parquet")]
        for name in named:
            data = tar.extractfile(name).read()  # type: ignore[union-attr]
            assert Path(name).name.endswith(f"-{zlib.crc32(data):08x}.parquet"), name
    assert len(named) == 3, named  # batches, metrics, groups
    shutil.rmtree(copy)  # nothing of the run is left but the file
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = subprocess.run([sys.executable, str(ROOT / "runner.py"), "rerun", str(out)],
                         cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "=== bundle of step 5 of" in res.stdout and "(from its step_3)" in res.stdout
    assert "made where this is run: exact agreement expected" in res.stdout
    assert "rerun step 4 on the way: match" in res.stdout
    assert "result: match — all" in res.stdout
    res = runner("bundle", str(run_dir), "--step", "9", "-o", str(tmp_path / "x.tar"))
    assert res.returncode == 2 and "step 9 is not recorded" in res.stderr
    (tmp_path / "not.tar").write_text("text")
    res = runner("rerun", str(tmp_path / "not.tar"))
    assert res.returncode == 2 and "is not a bundle" in res.stderr
