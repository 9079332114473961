"""Dataset files (verl layout, plain question/answer), deterministic weighted mixing, the
recorded (dataset, row) of each prompt and the position a resume restores from them."""

import collections
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.data.sources import make_task
from actors.job.config.load import apply_overrides, decode_topology
from actors.replay.state import ReplayState
from actors.runtime.config import ConfigError


def verl_rows(n):
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": 1000 + i, "tags": ["a", "b"], "ok": True}}
            for i in range(n)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def topology(*datasets, **task):
    data = {"task": {"datasets": list(datasets), **task}}
    return decode_topology(data)


def test_verl_jsonl_and_parquet_rows_become_prompts(tmp_path):
    rows = verl_rows(5)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "gsm.parquet")
    write_jsonl(tmp_path / "gsm.jsonl", rows)
    for name in ("gsm.parquet", "gsm.jsonl"):
        t = topology({"path": str(tmp_path / name), "shuffle": False,
                      "system_prompt": "Think step by step."})
        task = make_task(t.task, seed=0)
        assert task.locate(3) == ("gsm", 3)
        p = task.prompt(3, prompt_id=7)
        assert p.prompt_id == 7 and p.data_source == "openai/gsm8k" and p.ground_truth == "4"
        assert [(m.role, m.content) for m in p.messages] == [
            ("system", "Think step by step."), ("user", "What is 3 + 1?")]
        assert p.extra_info == {"index": 1003, "split": "train", "tags": '["a", "b"]', "ok": 1}
        assert task.prompt(8, 0).ground_truth == "4"  # second pass, same order without shuffle


def test_plain_question_answer_file_with_a_column_mapping(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "2+2?", "answer": 4}])
    t = topology({"path": str(path), "prompt_key": "question", "answer_key": "answer",
                  "data_source": "exact_match"})
    p = make_task(t.task, seed=0).prompt(0, 0)
    assert p.messages[0].content == "2+2?" and p.ground_truth == "4"
    assert p.data_source == "exact_match"


def test_shuffled_passes_are_permutations_and_differ(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", verl_rows(20))
    task = make_task(topology({"path": str(path)}).task, seed=3)
    first = [task.prompt(i, 0).extra_info["index"] for i in range(20)]
    second = [task.prompt(i, 0).extra_info["index"] for i in range(20, 40)]
    assert sorted(first) == sorted(second) == list(range(1000, 1020))
    assert first != second
    again = make_task(topology({"path": str(path)}).task, seed=3)
    assert [again.prompt(i, 0).extra_info["index"] for i in range(20)] == first


def test_mixture_is_deterministic_weighted_and_recoverable(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", verl_rows(10))
    t = topology({"path": str(path), "weight": 3}, {"builtin": "repeat_letter", "weight": 1})
    task = make_task(t.task, seed=5)
    draws = [task.locate(i) for i in range(4000)]
    share = collections.Counter(d for d, _ in draws)
    assert set(share) == {"gsm", "repeat_letter"}
    assert 0.72 < share["gsm"] / 4000 < 0.78
    # each dataset is read in order: its k-th draw takes its row k
    seen: dict[str, int] = collections.Counter()
    for d, row in draws:
        assert row == seen[d]
        seen[d] += 1
    # a function of (seed, index) only: random access and a fresh task agree
    assert make_task(t.task, seed=5).locate(2500) == draws[2500] == task.locate(2500)
    assert [make_task(t.task, seed=6).locate(i) for i in range(50)] != draws[:50]
    # the recorded (dataset, row) give back the next draw
    for i in (0, 1, 17, 999):
        rows_after = collections.Counter(d for d, _ in draws[: i + 1])
        assert task.index_after(dict(rows_after)) == i + 1
    assert task.index_after({}) == 0
    with pytest.raises(ValueError, match="no dataset"):
        task.index_after({"nope": 1})
    letter = task.prompt_at("repeat_letter", 4, prompt_id=1)
    assert letter.data_source == "repeat_letter" and letter.messages[-1].content.startswith("say")


def test_replay_records_dataset_rows_and_a_restored_position_continues_the_run(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", verl_rows(10))
    t = topology({"path": str(path)}, {"builtin": "arithmetic", "name": "sums", "weight": 2})

    def fresh():
        return ReplayState(task=make_task(t.task, seed=1), groups_per_step=100,
                           max_staleness=0, capacity=1000)

    run = fresh()
    first = run.issue(b"x", 30)
    recorded = [r for table, r in run.records if table == "prompts"]
    assert {r["dataset"] for r in recorded} == {"gsm", "sums"}
    for p, r in zip(first, recorded, strict=True):
        assert run.task.prompt_at(r["dataset"], r["row"], p.prompt_id) == p
    # resume from the recording: each dataset continues after its last recorded row
    next_rows = {}
    for r in recorded:
        next_rows[r["dataset"]] = max(next_rows.get(r["dataset"], 0), r["row"] + 1)
    resumed = fresh()
    resumed.next_row = resumed.task.index_after(next_rows)
    resumed.issued = run.issued
    assert resumed.next_row == run.next_row
    assert resumed.issue(b"x", 20) == run.issue(b"x", 20)


def test_bad_rows_name_the_dataset_and_row(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": 3, "data_source": "x",
                                               "reward_model": {"ground_truth": "1"}}])
    task = make_task(topology({"path": str(path)}).task, seed=0)
    with pytest.raises(ValueError, match=r"task.datasets\[0\] \(.*d.jsonl row 0\): prompt must be"):
        task.prompt(0, 0)
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "hi", "data_source": "x",
                                               "reward_model": {"style": "rule"}}])
    task = make_task(topology({"path": str(path)}).task, seed=0)
    with pytest.raises(ValueError, match="no field 'reward_model.ground_truth'"):
        task.prompt(0, 0)


@pytest.mark.parametrize(("entry", "message"), [
    ({"path": "missing.jsonl"}, r"task.datasets\[0\].path: no file 'missing.jsonl'"),
    ({"path": "d.csv"}, r"task.datasets\[0\].path: 'd.csv' is neither .parquet nor .jsonl"),
    ({"path": "{tmp}/d.jsonl", "weight": 0}, r"task.datasets\[0\].weight: must be > 0"),
    ({"path": "{tmp}/d.jsonl", "weight": -1}, r"task.datasets\[0\].weight: must be > 0"),
    ({}, r"task.datasets\[0\]: set one of path, builtin, reasoning_gym or verifiers"),
    ({"path": "{tmp}/d.jsonl", "builtin": "arithmetic"}, "set one of path, builtin, reasoning_gym"),
    ({"builtin": "chess"}, r"task.datasets\[0\].builtin: 'chess' is not one of"),
    ({"path": "{tmp}/d.jsonl", "prompt_key": "question"},
     r"task.datasets\[0\].prompt_key: no column 'question' .*columns: ability, data_source, extra_info, prompt"),
    ({"path": "{tmp}/d.jsonl", "answer_key": "answer"}, r"answer_key: no column 'answer'"),
    ({"path": "{tmp}/nosource.jsonl"}, r"task.datasets\[0\].data_source: .* no data_source column"),
    ({"path": "{tmp}/bad.jsonl"}, r"task.datasets\[0\].path: .*line 1 is not JSON"),
    ({"path": "{tmp}/d.jsonl", "colour": 1}, r"task.datasets\[0\].colour: unknown key"),
])
def test_bad_dataset_entries_name_the_key(tmp_path, entry, message):
    write_jsonl(tmp_path / "d.jsonl", verl_rows(2))
    write_jsonl(tmp_path / "nosource.jsonl", [{"prompt": "x", "reward_model": {}}])
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    entry = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v
             for k, v in entry.items()}
    with pytest.raises(ConfigError, match=message):
        topology(entry)


def test_dataset_names_must_be_unique(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", verl_rows(2))
    with pytest.raises(ConfigError, match=r"task.datasets\[1\].name: 'd' is already"):
        topology({"path": str(tmp_path / "d.jsonl")}, {"path": str(tmp_path / "d.jsonl")})


def test_dataset_paths_are_made_absolute_and_overrides_work(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "d.jsonl", verl_rows(2))
    monkeypatch.chdir(tmp_path)
    t = decode_topology(apply_overrides({}, [
        "task.datasets=[{path='d.jsonl', weight=2}, {builtin='repeat_letter'}]"]))
    assert t.task.datasets[0].path == str(tmp_path / "d.jsonl")
    assert t.task.datasets[0].weight == 2 and t.task.datasets[1].builtin == "repeat_letter"


def test_prompt_tokens_are_counted_as_the_sampler_templates_them(tmp_path):
    from actors.data.chat import prompt_token_counter
    from messages.rollout import ChatMessage, Prompt
    from tests.tiny_model import build_tiny_model

    count = prompt_token_counter(str(build_tiny_model(tmp_path / "model")))
    # <|im_start|> u s e r \n s a y _ a <|im_end|> \n <|im_start|> a s s i s t a n t \n
    assert count(Prompt(0, [ChatMessage("user", "say a")], "x", "a")) == 24
    assert count(Prompt(0, [ChatMessage("user", "say ab")], "x", "a")) == 25
