"""Served models' config (``[[reward.models]]``, one Struct per kind) and the choices made from
it: every bad key named (exit 2 from the runner), the replicas as reward processes and the pools
that score (``score_targets``), their placement on GPUs, the judge's parsers and template
fields, and the sampler's combination of the pools' replies. Scoring itself:
tests/test_served_scoring.py; a live job: tests/test_pools_job.py."""

from __future__ import annotations

import pytest

from actors.job.config.load import apply_overrides, decode_topology
from actors.runtime.config import ConfigError, model_replica, reward_processes, score_targets
from actors.scoring.combine import combine
from actors.scoring.items import ScoreItem
from actors.scoring.judge import (
    judge_fields,
    parse_boxed,
    parse_number,
    parse_score_tag,
    parse_yes_no,
)
from messages.reward import ScoreReply, ScoreResult
from messages.rollout import ChatMessage
from tests.tiny_model import build_tiny_reward_model


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "model")


def topology(*overrides: str):
    return decode_topology(apply_overrides({}, ["sampler.engine=hf", *overrides]))


def models(*entries: str) -> str:
    return "reward.models=[" + ", ".join("{" + e + "}" for e in entries) + "]"


def items(n: int = 3) -> list[ScoreItem]:
    prompt = [ChatMessage("system", "be brief"), ChatMessage("user", "what is 2 + 3?")]
    return [ScoreItem("arithmetic", f"it is {i}", "5", prompt=prompt) for i in range(n)]


# ------------------------------------------------------------------------------ config


def test_model_replicas_follow_the_rule_workers_and_targets_are_chosen_in_one_place(reward_model):
    topo = topology("reward.count=2", models(f'kind="reward_model", name="rm", path="{reward_model}", '
                                             'replicas=2', f'name="judge", kind="judge", '
                                             f'path="{reward_model}", replicas=1, weight=0.5'))
    R = topo.reward
    assert reward_processes(R) == 5
    assert [model_replica(R, i) and (model_replica(R, i)[0].name, model_replica(R, i)[1])
            for i in range(-1, 5)] == [None, None, None, ("rm", 0), ("rm", 1), ("judge", 0)]
    assert [m.kind for m in R.models] == ["reward_model", "judge"]
    assert score_targets(R) == (("reward", 1.0), ("rm", 1.0), ("judge", 0.5))
    only = topology("reward.rules=false", models(f'kind="reward_model", name="rm", '
                                                 f'path="{reward_model}"'))
    assert score_targets(only.reward) == (("rm", 1.0),)
    assert score_targets(topology().reward) == (("reward", 1.0),)  # no served models: as before


@pytest.mark.parametrize(("entry", "key", "why"), [
    ('kind="reward_model", name="reward", path="{rm}"', "reward.models[0].name", "rule workers' pool"),
    ('kind="reward_model", name="a b", path="{rm}"', "reward.models[0].name", "letters, digits"),
    ('kind="reward_model", name="x", path="/nonexistent"', "reward.models[0].path",
     "not a model directory"),
    ('kind="reward_model", name="x", path="{rm}", replicas=0', "reward.models[0].replicas", ">= 1"),
    ('kind="reward_model", name="x", path="{rm}", device="gpu"', "reward.models[0].device",
     "not cpu, cuda"),
    ('kind="reward_model", name="x", path="{rm}", capacity=0', "reward.models[0].capacity", ">= 1"),
    ('kind="reward_model", name="x", path="{rm}", reward_std=0.0', "reward.models[0].reward_std",
     "> 0"),
    ('kind="reward_model", name="x", path="{rm}", sleep_idle_s=-1.0',
     "reward.models[0].sleep_idle_s", ">= 0"),
    ('name="x", kind="judge", path="{rm}", template="rate {answer}"',
     "reward.models[0].template", "unknown field {answer}"),
    ('name="x", kind="judge", path="{rm}", template="rate {response"',
     "reward.models[0].template", "braces"),
    ('name="x", kind="judge", path="{rm}", template="rate it"', "reward.models[0].template",
     "names no field"),
    ('name="x", kind="judge", path="{rm}", parser="function"',
     "reward.models[0].function_path", "no file"),
    ('name="x", kind="judge", path="{rm}", function_path="{rm}/config.json"',
     "reward.models[0].function_path", "only with parser = function"),
    ('name="x", kind="judge", path="{rm}", engine="vllm", sleep_idle_s=5.0',
     "reward.models[0].sleep_idle_s", "no sleep mode on a CPU"),
    ('name="x", kind="judge", path="{rm}", parser="regex"', "reward.models[0].parser",
     "Invalid enum"),
    ('kind="reward_model", name="x", path="{rm}", replica=2', "reward.models[0]", "replica"),
    # each kind has only its own options, and the kind is named
    ('kind="reward_model", name="x", path="{rm}", parser="number"', "reward.models[0].parser",
     "unknown key"),
    ('kind="reward_model", name="x", path="{rm}", engine="hf"', "reward.models[0].engine",
     "unknown key"),
    ('kind="judge", name="x", path="{rm}", reward_std=2.0', "reward.models[0].reward_std",
     "unknown key"),
    ('kind="pool", name="x", path="{rm}"', "reward.models[0].kind", "Invalid value 'pool'"),
    ('name="x", path="{rm}"', "reward.models[0].kind", "must be set"),
])
def test_every_bad_model_key_is_named(reward_model, entry, key, why):
    with pytest.raises(ConfigError) as err:
        topology(models(entry.replace("{rm}", str(reward_model))))
    assert key in str(err.value) and why in str(err.value), str(err.value)


def test_two_pools_of_one_name_and_rules_off_without_models_are_refused(reward_model):
    with pytest.raises(ConfigError, match=r"reward.models\[1\].name: 'x' names two pools"):
        topology(models(f'kind="reward_model", name="x", path="{reward_model}"',
                        f'kind="judge", name="x", path="{reward_model}"'))
    with pytest.raises(ConfigError, match="reward.rules: false needs at least one"):
        topology("reward.rules=false")


def test_a_bad_model_key_stops_the_runner_with_exit_2(reward_model, tmp_path):
    import subprocess
    import sys

    from tests.jobs import ROOT

    done = subprocess.run([sys.executable, "runner.py", "check", "topology.toml",
                           models(f'kind="reward_model", name="rm", path="{reward_model}", '
                                  'replicas=0')],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "error: bad topology: reward.models[0].replicas: must be >= 1" in done.stderr


# ------------------------------------------------------------------------------ parsers


def test_parsers_read_the_judges_conventions_and_nothing_else():
    assert parse_number("I would say 7.5 out of 10") == 10.0  # the last number
    assert parse_number("Score:\n\n8") == 8.0 and parse_number("no score") is None
    assert parse_score_tag("Rating: [[6]] (was [[3]])") == 3.0
    assert parse_score_tag("Rating: [[ 6 ]]") == 6.0 and parse_score_tag("Rating: [6]") is None
    assert parse_boxed(r"so \boxed{4} or \boxed{-1.5}") == -1.5 and parse_boxed(r"\boxed{x}") is None
    assert parse_yes_no("Is it right? Yes.") == 1.0 and parse_yes_no("no, not really") == 0.0
    assert parse_yes_no("Nobody knows, yesterday") is None  # whole words only


def test_template_fields_come_from_the_item():
    (item,) = items(1)
    fields = judge_fields(item)
    assert fields["prompt"] == fields["problem"] == "what is 2 + 3?"  # system text left out
    assert fields["response"] == fields["solution"] == "it is 0"
    assert fields["ground_truth"] == "5" and fields["data_source"] == "arithmetic"


# ------------------------------------------------------------------------------ combining


def test_the_pools_replies_add_up_by_weight_and_any_failure_fails_the_response():
    rules = ScoreReply([ScoreResult(1.0, answer="5", extra={"acc": 1.0}), ScoreResult(0.0)])
    judge = ScoreReply([ScoreResult(0.8, extra={"judge_raw": 8.0}),
                        ScoreResult(0.0, error="judge j: parser number read no score")])
    both = combine((("reward", 1.0), ("j", 0.5)), [rules, judge])
    assert both.results[0].score == pytest.approx(1.4)
    assert both.results[0].extra == {"reward": 1.0, "reward/acc": 1.0, "j": 0.8,
                                     "j/judge_raw": 8.0}
    assert both.results[0].answer == "5"
    assert both.results[1].score == 0.0
    assert both.results[1].error == "j: judge j: parser number read no score"
    assert combine((("reward", 1.0),), [rules]) is rules  # no pools: the reply as it came


# ------------------------------------------------------------------------------ placement


def test_model_replicas_are_reward_processes_placed_on_their_gpu(reward_model, tmp_path, sockets):
    """A model on cuda:1 shares that GPU with the sampler placed there (each gets a memory
    share); a cpu model and the rule worker see no GPU; a GPU the runner lacks names the key."""
    from tests.test_placement import envs
    from tests.test_placement import topology as placed_topology

    topo = placed_topology(sockets, "sampler.count=2", "sampler.engine=hf", models(
        f'kind="reward_model", name="rm", path="{reward_model}", replicas=2, device="cuda:1"',
        f'kind="reward_model", name="cpu_rm", path="{reward_model}"'))
    got = envs(topo, tmp_path, ["0", "1"])
    for name in ("reward-1", "reward-2"):
        assert got[name] == {"CUDA_VISIBLE_DEVICES": "1", "FLOWRL_DEVICE": "cuda:0",
                             "FLOWRL_GPU_MEMORY_SHARE": "0.30"}  # with sampler-0: 0.9 / 3
    assert got["reward-3"] == got["reward-0"] == {"CUDA_VISIBLE_DEVICES": "", "FLOWRL_DEVICE": "cpu"}
    with pytest.raises(ConfigError, match=r"reward.models\[0\].device: cuda:1 asked for, but the "
                                          r"runner sees 1 GPU"):
        envs(topo, tmp_path, ["0"])


def test_a_reward_model_needs_a_one_label_classifier(tiny_model):
    with pytest.raises(ConfigError, match=r"reward.models\[0\].path: .*not a "
                                          r"\.\.\.ForSequenceClassification reward model"):
        topology(models(f'kind="reward_model", name="rm", path="{tiny_model}"'))  # a causal LM
