"""The whole job on a jsonl dataset mixed with a built-in task, with DAPO dynamic sampling and
group reuse on: counters balance, filtered groups and reused serves show up in the metrics and
in the recording."""

from __future__ import annotations

import json
import subprocess

from tests.jobs import ROOT, balanced, command, metrics


def test_mixed_datasets_with_filtering_and_reuse(tiny_model, tmp_path):
    # verl layout; "say q" rows expect the empty answer, which repeat_letter scores 0.0 whatever
    # the reply, so their groups have equal rewards and must be filtered
    rows = [{"data_source": "repeat_letter",
             "prompt": [{"role": "user", "content": f"say {letter}"}],
             "reward_model": {"style": "rule", "ground_truth": truth},
             "extra_info": {"split": "train", "index": i}}
            for i, (letter, truth) in enumerate([("a", "a"), ("q", ""), ("b", "b"), ("q", "")])]
    data = tmp_path / "letters.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    res = subprocess.run(command(
        tiny_model, run_dir, "learner.total_steps=4", "learner.save_every=100",
        f"task.datasets=[{{path='{data}', weight=1}}, {{builtin='repeat_letter', weight=1}}]",
        "algorithm.filter_groups.enable=true", "replay.reuse=2"),
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 5))
    assert all(balanced(r) for r in rows)
    assert all(r["replay/served"] == r["replay/trained"] + r["replay/reused"] for r in rows)
    last = rows[-1]
    assert last["replay/served"] == 4 * 4 and last["replay/reused"] > 0
    assert last["replay/dropped_filtered"] > 0
    assert sum(r["replay/step_filtered"] for r in rows) <= last["replay/dropped_filtered"]
    assert max(r["replay/age_served_max"] for r in rows) == 2
    assert max(r["staleness/max"] for r in rows) <= 1

    from actors.runtime.recording import read_table
    prompts = read_table(run_dir, "prompts").to_pylist()
    assert {p["dataset"] for p in prompts} == {"letters", "repeat_letter"}
    fates = read_table(run_dir, "fates").to_pylist()
    groups = {g["group_id"]: g for g in read_table(run_dir, "groups").to_pylist()}
    filtered = [f["group_id"] for f in fates if f["reason"] == "filtered"]
    assert filtered and all(len(set(groups[g]["rewards"])) == 1 for g in filtered)
    assert any(f["fate"] == "trained" and f["served"] == 2 for f in fates)
