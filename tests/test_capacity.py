"""A /dev/shm too small for the shared-memory weights transport is a config error at start
naming learner.weights_transport (Docker's default is 64 MB), not a learner crash at its first
publish."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from actors.job.config.capacity import check_shm, parameter_count, sent_dtype
from actors.job.config.load import apply_overrides, decode_topology
from actors.runtime.config import ConfigError
from actors.runtime.transports.shm import SHM_KEEP
from actors.runtime.transports.table import TRANSPORTS

VERSIONS_AT_ONCE = TRANSPORTS["shm"].shm_versions  # what the check counts


def topo(model, *extra: str):
    return decode_topology(apply_overrides({}, [
        f"model.path={model}", "learner.weights_address=ipc:///tmp/x/weights", *extra]))


def test_the_parameter_count_is_the_models(tiny_model, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    exact = sum(p.numel() for p in model.parameters())
    assert parameter_count(tiny_model) == exact
    # without safetensors files: estimated from config.json (the same architecture here)
    (tmp_path / "config.json").write_text((tiny_model / "config.json").read_text())
    assert parameter_count(tmp_path) == exact


def test_a_config_setting_head_dim_is_counted_with_its_heads_width(tmp_path):
    """Qwen3's and Gemma's heads are not ``hidden // heads`` wide: the config's head_dim rules."""
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, vocab_size=128)
    with torch.device("meta"):
        exact = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    config.save_pretrained(tmp_path)
    assert parameter_count(tmp_path) == exact


def test_a_shm_smaller_than_the_weights_versions_is_an_error_naming_the_transport(tiny_model):
    version = parameter_count(tiny_model) * 4  # float32 on a CPU
    with pytest.raises(ConfigError, match="learner.weights_transport"):
        check_shm(topo(tiny_model), shm_bytes=VERSIONS_AT_ONCE * version - 1)
    check_shm(topo(tiny_model), shm_bytes=VERSIONS_AT_ONCE * version)  # fits
    # zmq does not use it; bf16 weights need half
    check_shm(topo(tiny_model, "learner.weights_transport=zmq"), shm_bytes=0)
    check_shm(topo(tiny_model, "learner.weights_dtype=bfloat16"),
              shm_bytes=VERSIONS_AT_ONCE * version // 2)


def test_the_check_counts_the_versions_the_transport_keeps(tiny_model):
    assert VERSIONS_AT_ONCE == SHM_KEEP + 1  # kept ones, and the one being written
    assert sent_dtype(topo(tiny_model), learner_on_gpu=True) == "bfloat16"
    assert sent_dtype(topo(tiny_model), learner_on_gpu=False) == "float32"


def test_the_real_dev_shm_is_read_when_no_size_is_given(tiny_model, tmp_path):
    check_shm(topo(tiny_model), shm_dir=tmp_path)  # a folder on disk: large enough here
