"""LoRA on a vision-language model (the tiny random Qwen2.5-VL): adapters on the language model
alone by default (the tower's MLP shares its layer names, yet gets none), on every linear layer
of the vision tower too with ``learner.lora.vision``, where they train and reach the sampler."""

from __future__ import annotations

import anyio
import pytest
import torch

from actors.data.chat import ChatTokenizer
from actors.job.config.load import apply_overrides, decode_topology
from actors.learner.batch import build_batch
from actors.learner.objective import response_logprobs
from actors.runtime.config import ConfigError
from actors.runtime.transports.sources import AdapterWeights
from actors.sampler.engines.base import AdapterLimits, GenerateRequest
from actors.sampler.engines.hf import HFEngine
from messages.rollout import SamplingParams
from tests.learner_cases import make_trainer
from tests.test_packing import gradients
from tests.test_vision import PROMPTS, as_groups, engine_groups

LORA = ("learner.lora.rank=4", "learner.lora.alpha=32", "algorithm.n=2",
        "learner.groups_per_step=4")
TOWER = ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "merger.mlp.0",
         "merger.mlp.2")


def adapted(model) -> set[str]:
    """The modules that carry an adapter (their names in the base model)."""
    return {n.split(".lora_A.")[0].removeprefix("base_model.model.")
            for n, _ in model.named_parameters() if ".lora_A." in n}


def test_the_default_puts_adapters_on_the_language_model_alone(tiny_vlm, tmp_path):
    trainer = make_trainer(tiny_vlm, tmp_path, *LORA)
    modules = adapted(trainer.policy.model)
    assert len(modules) == 2 * 7 and all(".language_model." in m for m in modules)
    assert not any(".visual." in t for t in trainer.policy.adapter_spec().target_modules)


def test_vision_adapters_train_and_the_sampler_applies_them(tiny_vlm, tmp_path):
    """With ``learner.lora.vision`` every linear layer of the tower has an adapter whose B
    matrix gets a gradient at the first step (A's is 0 while B starts at 0); the version's
    adapters, loaded into the HF engine, give behaviour log-probs equal to the learner's on
    prompts with images (float32, the bound of the HF parity test)."""
    trainer = make_trainer(tiny_vlm, tmp_path, *LORA, "learner.lora.vision=true")
    policy = trainer.policy
    tower = {m for m in adapted(policy.model) if ".visual." in m}
    assert {m.split("visual.")[1].removeprefix("blocks.0.") for m in tower} == set(TOWER)
    grads = gradients(trainer)
    trainer.train_step(engine_groups(tiny_vlm, PROMPTS))
    b = {k: g for k, g in grads[0].items() if ".visual." in k and ".lora_B." in k}
    assert len(b) == len(TOWER) and all(float(g.abs().max()) > 0 for g in b.values()), \
        {k: float(g.abs().max()) for k, g in b.items()}

    spec = policy.adapter_spec()
    adapters = dict(policy.adapter_snapshot(torch.float32))
    assert sum(".visual." in n for n in adapters) == 2 * len(TOWER)
    engine = HFEngine(tiny_vlm, "float32", seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=6)
    tok = ChatTokenizer(tiny_vlm)
    ids = [tok.prompt_ids(m, images=i) for m, i in PROMPTS]

    async def sample():
        await engine.load_weights(policy.version, AdapterWeights(spec, adapters))
        return await engine.generate([GenerateRequest(p, params, 2, images=tuple(i))
                                      for p, (_, i) in zip(ids, PROMPTS, strict=True)])

    groups = as_groups(anyio.run(sample, backend="trio"), PROMPTS, ids, params, version=1)
    batch = build_batch(groups, policy.pad_id, policy.processor)
    at = batch.response_mask.bool()
    with torch.no_grad():
        learner = response_logprobs(policy.model.eval(), batch, 1.0)
        base = policy.reference_logprobs(batch, 1.0)
        for name, p in policy.model.named_parameters():  # the tower's adapters off
            if ".visual." in name and ".lora_B." in name:
                p.zero_()
        blind = response_logprobs(policy.model, batch, 1.0)
    worst = float((learner - batch.behaviour_logprobs)[at].abs().max())
    apart = float((base - batch.behaviour_logprobs)[at].abs().max())
    tower = float((blind - batch.behaviour_logprobs)[at].abs().max())
    print(f"\nvision LoRA: sampler vs learner max |diff| {worst:.2e}; vs the base {apart:.2e}, "
          f"vs the learner without the tower's adapters {tower:.2e}")
    assert worst < 1e-5 and apart > 1e-3 and tower > 1e-4


def test_vision_adapters_need_a_tower_that_trains_and_reach_vllms_tower(tiny_vlm, tiny_model):
    from actors.job.config.capacity import adapter_count
    from actors.sampler.engines.vllm.lora import lora_options

    def topology(model, *overrides):
        return decode_topology(apply_overrides({}, [f"model.path={model}", "learner.lora.rank=4",
                                                    "sampler.engine=hf", *overrides]))

    topology(tiny_vlm, "learner.lora.vision=true")
    with pytest.raises(ConfigError, match=r"learner\.lora\.vision: .* has no vision tower"):
        topology(tiny_model, "learner.lora.vision=true")
    with pytest.raises(ConfigError, match=r"learner\.lora\.vision: .*model\.freeze_vision"):
        topology(tiny_vlm, "learner.lora.vision=true", "model.freeze_vision=true")
    assert "enable_tower_connector_lora" not in lora_options(AdapterLimits(4, 3))
    assert lora_options(AdapterLimits(4, 3, vision=True))["enable_tower_connector_lora"]
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    language, both = adapter_count(tiny_vlm, 4, names), adapter_count(tiny_vlm, 4, names, True)
    assert language == 2 * 4 * sum(o + i for o, i in [(64, 64), (32, 64), (32, 64), (64, 64),
                                                      (128, 64), (128, 64), (64, 128)])
    assert both - language == 4 * sum(o + i for o, i in [(96, 32), (32, 32), (64, 32), (64, 32),
                                                         (32, 64), (128, 128), (64, 128)])


def test_a_checkpoint_with_vision_adapters_resumes_with_them(tiny_vlm, tmp_path):
    """The checkpoint names the adapted layers in full (PEFT's adapter_config): a resumed
    learner has the same adapters, the tower's included, with the trained values."""
    trainer = make_trainer(tiny_vlm, tmp_path, *LORA, "learner.lora.vision=true")
    trainer.train_step(engine_groups(tiny_vlm, PROMPTS[:1]))
    trainer.policy.save_checkpoint()
    saved = dict(trainer.policy.adapter_snapshot())
    resumed = make_trainer(tiny_vlm, tmp_path, *LORA, "learner.lora.vision=true",
                           "learner.resume=true")
    assert resumed.policy.step == 1
    assert resumed.policy.adapter_spec() == trainer.policy.adapter_spec()
    again = dict(resumed.policy.adapter_snapshot())
    assert set(again) == set(saved) and any(".visual." in n for n in again)
    assert all(torch.equal(again[n], saved[n]) for n in saved)
