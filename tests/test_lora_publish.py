"""LoRA publishes the adapters alone: megabytes through the same weights transports, applied by
the sampler's engine to the base it started with; the behaviour log-probs it samples with are
the learner's recomputation with the adapter, not the base's. An engine that cannot apply
adapters is a config error at start."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import torch
import zmq

from actors.data.chat import chat_ids
from actors.job.config.load import apply_overrides, decode_topology
from actors.learner.batch import build_batch
from actors.learner.objective import response_logprobs
from actors.runtime.config import ConfigError
from actors.runtime.tensors import to_wire
from actors.runtime.transports.sources import AdapterWeights
from actors.runtime.transports.table import TRANSPORTS
from actors.runtime.weights import WeightsPublisher, WeightsSubscriber
from actors.runtime.zmq_bridge import make_socket
from actors.sampler.engines.base import GenerateRequest
from actors.sampler.engines.hf import HFEngine
from messages.rollout import ChatMessage, Prompt, Sample, SamplingParams, ScoredGroup
from tests.learner_cases import make_trainer
from tests.test_learner import make_groups

SAMPLING = SamplingParams(temperature=1.0, max_tokens=6)


def topology(*overrides: str):
    return decode_topology(apply_overrides({}, list(overrides)))


def test_a_sampler_that_cannot_apply_the_adapters_is_a_config_error(tiny_model, monkeypatch):
    from actors.runtime.config import engines as registry

    lora = [f"model.path={tiny_model}", "learner.lora.rank=8"]
    monkeypatch.setattr(registry.ENGINES["hf"], "adapters", False)
    with pytest.raises(ConfigError, match=r"sampler\.engine: hf cannot apply the LoRA adapters "
                                          r"learner\.lora\.rank = 8 publishes"):
        topology(*lora, "sampler.engine=hf")
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"learner\.lora\.target_modules: \['c_attn'\] are no "
                                          r"linear module"):
        topology(*lora, "sampler.engine=hf", 'learner.lora.target_modules=["q_proj", "c_attn"]')
    with pytest.raises(ConfigError, match=r"learner\.lora\.rank: vllm serves LoRA ranks up to 512"):
        topology(f"model.path={tiny_model}", "learner.lora.rank=1024", "sampler.engine=vllm")
    for engine in ("hf", "vllm"):  # the learner would never train an LM-head adapter
        with pytest.raises(ConfigError, match=r"learner\.lora\.target_modules: \['lm_head'\]: "
                                              r"adapters on the LM head"):
            topology(*lora, f"sampler.engine={engine}",
                     'learner.lora.target_modules=["q_proj", "lm_head"]')
    # adapters over nccl to vllm: the sampler process receives them (tests/test_vllm_lora.py)
    topology(*lora, "sampler.engine=vllm", "learner.weights_transport=nccl",
             'learner.weights_address="tcp://127.0.0.1:5555"')
    topology(*lora, "sampler.engine=hf")
    topology(*lora, "sampler.engine=vllm")


def sampled_groups(prompt_ids: list[int], generations) -> list[ScoredGroup]:
    """The engine's completions as the scored group the learner would train on."""
    samples = [Sample(to_wire(g.token_ids), to_wire(g.logprobs), g.version, "", g.finish_reason,
                      token_versions=to_wire(g.versions), loss_mask=to_wire(g.loss_mask))
               for g in generations]
    prompt = Prompt(0, [ChatMessage("user", "x")], "repeat_letter", "a")
    return [ScoredGroup(prompt, to_wire(torch.tensor(prompt_ids, dtype=torch.int32)), samples,
                        "s", sampling=SAMPLING)]


def per_sample(lp: torch.Tensor, group: ScoredGroup) -> list[torch.Tensor]:
    start = group.prompt_ids.shape[0] - 1
    return [lp[i, start:start + s.response_ids.shape[0]] for i, s in enumerate(group.samples)]


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["shm", "zmq", "nccl"])  # nccl: over gloo on the CPU
async def test_sampler_logprobs_after_an_adapter_update_are_the_learners(tiny_model, tmp_path,
                                                                         sockets, transport):
    trainer = make_trainer(tiny_model, tmp_path, "learner.lora.rank=4", "learner.lora.alpha=32")
    trainer.train_step(make_groups(trainer))  # lora_B starts at 0: a step makes it count
    policy = trainer.policy
    adapters = policy.adapter_snapshot(torch.float32)
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n, _ in adapters)
    full = sum(t.numel() for _, t in policy.snapshot())
    assert sum(t.numel() for _, t in adapters) < full / 5  # adapters, not the model

    engine = HFEngine(tiny_model, "float32", seed=0)
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    zctx = zmq.Context()
    address = f"ipc://{sockets}/weights"
    try:
        with anyio.fail_after(120), \
                make_socket(zctx, zmq.ROUTER, bind=address) as learner_sock, \
                make_socket(zctx, zmq.DEALER, connect=address) as sampler_sock:
            options = {"address": "127.0.0.1", "timeout_s": 60} if transport == "nccl" else {}
            publisher = WeightsPublisher(learner_sock,
                                         TRANSPORTS[transport].load().sender(**options))
            subscriber = WeightsSubscriber(sampler_sock)
            async with anyio.create_task_group() as tg:
                tg.start_soon(publisher.serve)
                tg.start_soon(subscriber.serve)
                await publisher.publish(policy.version, adapters, adapter=policy.adapter_spec())
                await subscriber.wait_for(policy.version)
                version, source = subscriber.take()
                assert isinstance(source, AdapterWeights)
                assert source.spec == policy.adapter_spec()
                await engine.load_weights(version, source)
                tg.cancel_scope.cancel()
            publisher.close()
            subscriber.close()
    finally:
        zctx.destroy(linger=0)
    assert engine.version == policy.version == 1
    now = {n.replace(".base_layer", ""): p for n, p in engine.model.named_parameters()
           if "lora_" not in n}
    assert set(now) == set(base)
    for name, value in base.items():  # the base never moves: only adapters were added
        assert torch.equal(now[name], value), name

    prompt_ids = chat_ids(policy.tokenizer, [ChatMessage("user", "say a")])
    (generations,) = await engine.generate([GenerateRequest(list(prompt_ids), SAMPLING, n=4)])
    assert all(bool((g.versions == 1).all()) for g in generations)
    groups = sampled_groups(list(prompt_ids), generations)
    batch = build_batch(groups, policy.pad_id)
    with torch.no_grad():
        learner = per_sample(response_logprobs(policy.model, batch, SAMPLING.temperature),
                             groups[0])
        base_lp = per_sample(policy.reference_logprobs(batch, SAMPLING.temperature), groups[0])
    sampled = [g.logprobs for g in generations]
    worst = max(float((a - b).abs().max()) for a, b in zip(sampled, learner, strict=True))
    apart = max(float((a - b).abs().max()) for a, b in zip(sampled, base_lp, strict=True))
    assert worst < 1e-4, f"sampler vs learner with the adapter: max |diff| {worst}"
    assert apart > 1e-2, f"sampler vs the base: max |diff| {apart} (the adapter did nothing)"


@pytest.mark.anyio
async def test_adapters_of_another_shape_mid_run_are_refused(tiny_model):
    from messages.weights import AdapterSpec

    engine = HFEngine(tiny_model, "float32", seed=0)
    spec = AdapterSpec(rank=2, alpha=4.0, target_modules=["q_proj"])
    names = [n for n, _ in engine.model.named_parameters() if n.endswith("q_proj.weight")]
    tensors = {}
    for n in names:
        out, inp = engine.params[n].shape
        stem = "base_model.model." + n.removesuffix(".weight")
        tensors[f"{stem}.lora_A.weight"] = torch.ones(2, inp)
        tensors[f"{stem}.lora_B.weight"] = torch.ones(out, 2)
    await engine.load_weights(3, AdapterWeights(spec, tensors))
    assert engine.version == 3
    bigger = msgspec.structs.replace(spec, rank=4)
    with pytest.raises(ValueError, match="changed shape"):
        await engine.load_weights(4, AdapterWeights(bigger, tensors))
    assert engine.version == 3


def test_the_shm_check_counts_the_adapters_a_lora_version_holds(tiny_model):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from actors.job.config.capacity import adapter_count, check_shm, parameter_count
    from actors.runtime.transports.table import TRANSPORTS

    VERSIONS_AT_ONCE = TRANSPORTS["shm"].shm_versions

    targets = ("q_proj", "v_proj", "down_proj")
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model),
                          LoraConfig(r=4, target_modules=list(targets)))
    exact = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
    assert adapter_count(tiny_model, 4, targets) == exact
    lora = topology(f"model.path={tiny_model}", "learner.lora.rank=4",
                    "learner.weights_address=ipc:///tmp/x/weights",  # shm: one host
                    f"learner.lora.target_modules={list(targets)}".replace("'", '"'))
    need = VERSIONS_AT_ONCE * exact * 4  # float32
    assert need < parameter_count(tiny_model) * 4  # fits the adapters, not the model
    check_shm(lora, shm_bytes=need)
    with pytest.raises(ConfigError, match="learner.weights_transport"):
        check_shm(lora, shm_bytes=need - 1)


def test_adapters_go_out_in_the_samplers_dtype(tiny_model):
    """With LoRA, ``learner.weights_dtype = "auto"`` sends the adapters in the samplers' dtype
    (cast once by the learner, not by every sampler), whatever the learner computes in; full
    weights keep the learner's compute dtype; an explicit setting wins."""
    from actors.job.config.capacity import sent_dtype
    from actors.learner.actor import weights_dtype
    from actors.runtime.config import samplers_dtype

    model = f"model.path={tiny_model}"
    lora = topology(model, "learner.lora.rank=4", "sampler.dtype=bfloat16", "learner.dtype=float32")
    assert samplers_dtype(lora, gpu_visible=False) == "bfloat16"
    assert sent_dtype(lora, learner_on_gpu=False) == "bfloat16"
    assert weights_dtype("auto", torch.float32, samplers=samplers_dtype(lora, False)) \
        == torch.bfloat16
    assert weights_dtype("float16", torch.float32, samplers="bfloat16") == torch.float16
    # sampler.dtype auto: bfloat16 where the sampler computes on a GPU, model.dtype on a CPU
    auto = topology(model, "learner.lora.rank=4", "sampler.device=auto")
    assert samplers_dtype(auto, gpu_visible=True) == "bfloat16"
    assert samplers_dtype(auto, gpu_visible=False) == auto.model.dtype == "float32"
    assert sent_dtype(auto, learner_on_gpu=False) == "float32"
    full = topology(model, "sampler.dtype=bfloat16", "learner.dtype=float32")
    assert sent_dtype(full, learner_on_gpu=False) == "float32"  # full weights: the learner's
    assert weights_dtype("auto", torch.float32) == torch.float32
