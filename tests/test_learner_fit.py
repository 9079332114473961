"""What makes a large model fit: gradient checkpointing and FSDP2's CPU offload change where
memory goes, not the step (the same gradients, on the CPU, on gloo)."""

from __future__ import annotations

import pytest
import torch

from actors.learner.memory import gradient_checkpointing
from tests.learner_cases import make_trainer
from tests.test_learner import make_groups
from tests.test_packing import compare, gradients

REL = 1e-6


@pytest.mark.parametrize("option", ["learner.gradient_checkpointing=true", "learner.offload=true"])
def test_option_takes_the_same_step(tiny_model, tmp_path, option):
    plain = make_trainer(tiny_model, tmp_path / "plain", "learner.gradient_checkpointing=false")
    other = make_trainer(tiny_model, tmp_path / "other", option)
    assert other.policy.model.is_gradient_checkpointing == ("checkpointing" in option)
    g_plain, g_other = gradients(plain), gradients(other)
    groups = make_groups(plain, behaviour_offset=-0.2)
    m_plain, m_other = plain.train_step(groups), other.train_step(groups)
    worst, mean, scale = compare(g_plain[0], g_other[0])
    print(f"\n{option}: gradients max diff {worst:.2e} mean {mean:.2e} (largest {scale:.2e})")
    assert scale > 1e-4 and worst <= REL * scale
    assert m_other["actor/pg_loss"] == pytest.approx(m_plain["actor/pg_loss"], rel=REL, abs=REL)
    after = dict(other.policy.snapshot())
    for name, value in plain.policy.snapshot():
        assert torch.allclose(after[name], value, atol=1e-6), name


def test_offload_reaches_fully_shard(tiny_model, tmp_path):
    from torch.distributed.fsdp import CPUOffloadPolicy

    t = make_trainer(tiny_model, tmp_path, "learner.offload=true")
    assert t.group.distributed  # a process group of one: FSDP2 holds the offload
    policies = {name: type(m._get_fsdp_state()._fsdp_param_group.offload_policy)
                for name, m in t.policy.model.named_modules() if hasattr(m, "_get_fsdp_state")}
    assert set(policies) >= {"", "model.layers.0", "model.layers.1"}
    assert set(policies.values()) == {CPUOffloadPolicy}
    shard = next(t.policy.model.parameters())
    assert shard.device.type == "cpu"


def test_checkpointing_is_on_by_default_on_a_gpu_only_where_memory_needs_it():
    gpu, gb = torch.device("cuda", 0), 2**30
    assert gradient_checkpointing("auto", gpu)  # nothing known of the need: on
    assert not gradient_checkpointing("auto", gpu, lambda: 10 * gb, usable=80 * gb)
    assert gradient_checkpointing("auto", gpu, lambda: 50 * gb, usable=80 * gb)
    assert not gradient_checkpointing("auto", torch.device("cpu"), lambda: 50 * gb, usable=gb)
    assert gradient_checkpointing(True, torch.device("cpu"))
    assert not gradient_checkpointing(False, torch.device("cuda", 0))


def test_offload_with_lora_is_a_config_error():
    from actors.job.config.load import apply_overrides, decode_topology
    from actors.runtime.config import ConfigError

    with pytest.raises(ConfigError, match="learner.offload: needs full fine-tuning"):
        decode_topology(apply_overrides({}, ["learner.offload=true", "learner.lora.rank=4"]))


OFFLOAD_COLLECTIVES = """
import torch, torch.distributed as dist
dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
out = torch.empty(4)
dist.all_gather_into_tensor(out, torch.arange(4.0))  # what publishing offloaded shards runs
norm = torch.tensor([9.0])
dist.all_reduce(norm)  # what clip_grad_norm_ over offloaded gradients runs
print(out.tolist(), norm.item())
dist.destroy_process_group()  # (left to the interpreter's exit, gloo's threads may abort it)
"""


def test_an_offloading_learner_on_gpus_has_gloo_beside_nccl():
    """FSDP2's CPU offload keeps the shards in host memory: the weights' all-gather, gradient
    clipping and the state dict are collectives on CPU tensors, which an NCCL-only group
    refuses. The backend names gloo for CPU tensors beside NCCL for CUDA ones; a CPU shows the
    device-typed form runs those collectives (bench/gpu_check.py's offload row runs the step)."""
    import subprocess
    import sys

    from actors.learner.distributed import backend_for

    assert backend_for(torch.device("cuda", 0), offload=True) == "cpu:gloo,cuda:nccl"
    assert backend_for(torch.device("cuda", 0), offload=False) == "nccl"
    assert backend_for(torch.device("cpu"), offload=True) == "gloo"
    done = subprocess.run([sys.executable, "-c", OFFLOAD_COLLECTIVES], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["[0.0,", "1.0,", "2.0,", "3.0]", "9.0"], \
        done.stdout + done.stderr


def test_auto_checkpointing_needs_follow_the_model_and_the_micro_batch(tiny_model, tmp_path):
    """The need auto weighs: the policy's estimate without checkpointing for a micro-batch of
    so many tokens (grows with them; the default model at 32k tokens is about 25 GiB)."""
    from actors.learner.memory import needs_without_checkpointing

    policy = make_trainer(tiny_model, tmp_path / "a").policy
    needs = needs_without_checkpointing(policy)
    a, b = needs(1000), needs(64000)
    assert 0 < a < b
