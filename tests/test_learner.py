"""The learner's step in-process on the tiny model: invariances and every option combination."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from actors.data.chat import chat_ids
from actors.learner.batch import build_batch
from actors.learner.objective import response_logprobs
from actors.learner.trainer import Trainer
from actors.runtime.config import apply_overrides, decode_topology
from actors.runtime.tensors import to_wire
from messages.rollout import ChatMessage, Prompt, Sample, SamplingParams, ScoredGroup
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


SAMPLING = SamplingParams(temperature=1.0, max_tokens=6)  # what the groups were sampled with


def make_trainer(model: Path, run_dir: Path, *overrides: str) -> Trainer:
    topo = decode_topology(apply_overrides({}, [f"model.path={model}", "learner.lr=1e-2",
                                                "algorithm.n=4", "learner.groups_per_step=2",
                                                "sampler.max_tokens=6", *overrides]))
    return Trainer(topo, run_dir)


def make_groups(trainer: Trainer, *, seed: int = 0, behaviour_offset: float = 0.0,
                version: int = 0) -> list[ScoredGroup]:
    """Two groups of four random responses; behaviour log-probs are the model's own (+ offset)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(2):
        prompt_ids = torch.tensor(chat_ids(trainer.policy.tokenizer,
                                           [ChatMessage("user", f"say {'ab'[g]}")]),
                                  dtype=torch.int32)
        samples = []
        for i in range(4):
            resp = torch.randint(3, 30, (2 + (i + g) % 5,), generator=gen, dtype=torch.int32)
            samples.append(Sample(to_wire(resp), to_wire(torch.zeros(len(resp))), version,
                                  "", "stop" if i % 2 else "length", reward=float((i + g) % 3 == 0)))
        prompt = Prompt(g, [ChatMessage("user", "x")], "repeat_letter", "a")
        groups.append(ScoredGroup(prompt, to_wire(prompt_ids), samples, "s", baseline_reward=0.5,
                                  sampling=SAMPLING))
    # fill in the behaviour log-probs with the current policy's (optionally shifted)
    batch = build_batch(groups, trainer.policy.pad_id)
    with torch.no_grad():
        lp = response_logprobs(trainer.policy.model, batch, SAMPLING.temperature)
    out, row = [], 0
    for g in groups:
        samples = []
        for s in g.samples:
            m = batch.response_mask[row].bool()
            samples.append(Sample(s.response_ids, to_wire(lp[row][m] + behaviour_offset),
                                  s.policy_version, s.text, s.finish_reason, s.reward))
            row += 1
        out.append(ScoredGroup(g.prompt, g.prompt_ids, samples, g.sampler,
                               baseline_reward=g.baseline_reward, sampling=g.sampling))
    return out


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.snapshot()}


def test_is_weights_are_one_when_behaviour_is_the_policy(tiny, tmp_path):
    t = make_trainer(tiny, tmp_path)
    m = t.train_step(make_groups(t))
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["rollout_corr/ess"] == pytest.approx(1.0, abs=1e-5)
    assert abs(m["rollout_corr/kl"]) < 1e-5
    assert m["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)


def captured_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Record the accumulated gradients when the optimizer steps."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.policy.optimizer.step

    def recording_step(*args, **kwargs):
        for name, p in trainer.policy.model.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad.detach().clone()
        return step(*args, **kwargs)

    trainer.policy.optimizer.step = recording_step
    trainer.policy.optimizer.step._wrapped_by_lr_sched = True  # the scheduler's own marker: no warning
    return grads


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_size_does_not_change_the_gradient(tiny, tmp_path, mode):
    """Losses aggregate over the whole mini-batch, so accumulation over micro-batches is exact."""
    agg = f"algorithm.loss_agg_mode={mode}"
    a = make_trainer(tiny, tmp_path / "a", "learner.micro_batch_size=8", "learner.max_grad_norm=1e9", agg)
    b = make_trainer(tiny, tmp_path / "b", "learner.micro_batch_size=3", "learner.max_grad_norm=1e9", agg)
    ga, gb = captured_gradients(a), captured_gradients(b)
    groups = make_groups(a, behaviour_offset=-0.3)
    a.train_step(groups)
    b.train_step(groups)
    scale = max(float(g.abs().max()) for g in ga.values())
    worst = max(float((ga[k] - gb[k]).abs().max()) for k in ga)
    assert scale > 1e-4 and worst < 1e-5 * scale, (worst, scale)


OPTIONS = {
    "grpo": [],
    "dr_grpo": ["algorithm.adv_estimator=dr_grpo"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_pp": ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.9"],
    "reinforce_pp_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "remax": ["algorithm.adv_estimator=remax"],
    "gae": ["algorithm.adv_estimator=gae", "algorithm.lam=0.9"],
    "opo": ["algorithm.adv_estimator=opo"],
    "passk": ["algorithm.adv_estimator=grpo_passk"],
    "gspo": ["algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean",
             "algorithm.clip_ratio_low=0.0003", "algorithm.clip_ratio_high=0.0004"],
    "reinforce": ["algorithm.policy_loss=reinforce"],
    "cispo": ["algorithm.policy_loss=cispo", "algorithm.clip_ratio_high=4.0"],
    "dapo_clip_higher": ["algorithm.clip_ratio_high=0.28", "algorithm.clip_ratio_c=0"],
    "seq_sum_norm": ["algorithm.loss_agg_mode=seq-mean-token-sum-norm"],
    "seq_token_sum": ["algorithm.loss_agg_mode=seq-mean-token-sum"],
    "kl_loss": ["algorithm.use_kl_loss=true", "algorithm.kl_loss_type=k3"],
    "kl_in_reward_adaptive": ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"],
    "entropy": ["algorithm.entropy_coeff=0.01"],
    "bypass": ["algorithm.correction.mode=bypass"],
    "seq_is": ["algorithm.correction.is_level=sequence", "algorithm.correction.normalize_weights=true"],
    "rejection": ["algorithm.correction.rejection=[{statistic='geo_mean', level='sequence', low=0.5, high=2.0}, {statistic='k3', level='token', high=0.5}]"],
    "epochs_minibatches": ["learner.ppo_epochs=2", "learner.ppo_mini_batches=2"],
    "cosine_warmup": ["learner.lr_scheduler=cosine", "learner.warmup_steps=1"],
    "grad_ckpt": ["learner.gradient_checkpointing=true"],
    "lora": ["learner.lora.rank=4", "algorithm.use_kl_loss=true"],
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_option_takes_a_finite_step(tiny, tmp_path, name):
    t = make_trainer(tiny, tmp_path, *OPTIONS[name])
    before = params(t)
    m = t.train_step(make_groups(t, behaviour_offset=-0.1))
    bad = {k: v for k, v in m.items() if not math.isfinite(v)}
    assert not bad, bad
    assert t.policy.step == 1
    moved = max(float((before[k] - v).abs().max()) for k, v in params(t).items())
    assert moved > 0, "the step did not change the policy"
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "rollout_corr/is_weight_mean",
                "staleness/mean"):
        assert key in m


def test_lora_snapshot_is_the_merged_base_model(tiny, tmp_path):
    t = make_trainer(tiny, tmp_path, "learner.lora.rank=4")
    t.train_step(make_groups(t))
    snap = dict(t.policy.snapshot())
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(tiny)
    assert set(snap) == {n for n, _ in base.named_parameters()}
    x = torch.randint(3, 30, (1, 7))
    with torch.no_grad():
        want = t.policy.model(input_ids=x).logits
        base.load_state_dict(snap, strict=False)
        got = base(input_ids=x).logits
    assert float((want - got).abs().max()) < 1e-4
    path = t.policy.save_checkpoint()
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert float((reloaded(input_ids=x).logits - want).abs().max()) < 1e-4


@pytest.mark.parametrize("extra", [[], ["algorithm.adv_estimator=gae"], ["learner.lora.rank=4"]],
                         ids=["full", "gae", "lora"])
def test_checkpoint_resume_restores_weights_and_step(tiny, tmp_path, extra):
    t = make_trainer(tiny, tmp_path, *extra)
    t.train_step(make_groups(t))
    t.policy.save_checkpoint()
    r = make_trainer(tiny, tmp_path, *extra)
    assert r.policy.step == 1 and r.policy.resumed_from is not None
    pa, pb = params(t), params(r)
    assert max(float((pa[k] - pb[k]).abs().max()) for k in pa) < 1e-6
    if t.policy.critic is not None:
        for (ka, va), (kb, vb) in zip(t.policy.critic.state_dict().items(), r.policy.critic.state_dict().items(), strict=True):
            assert ka == kb and torch.equal(va, vb)
    # the next step is the same from the original and from the resumed trainer
    groups = make_groups(t, seed=1)
    t.train_step(groups)
    r.train_step(groups)
    pa, pb = params(t), params(r)
    assert max(float((pa[k] - pb[k]).abs().max()) for k in pa) < 1e-5


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_a_stop_never_leaves_half_a_step(tiny, tmp_path):
    """An abandoned step changes no state (β of the adaptive KL controller included); once it
    has taken an optimizer update it finishes: a stop's checkpoint is a whole step's state."""
    from actors.learner.trainer import Aborted

    t = make_trainer(tiny, tmp_path, "learner.ppo_mini_batches=2", "algorithm.use_kl_in_reward=true",
                     "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=10")
    groups = make_groups(t)
    beta = t.policy.kl_ctrl.value
    zero_grad = t.policy.optimizer.zero_grad

    def stop_at_first_update(*args, **kwargs):  # the KL penalty is computed by then
        t.abort.set()
        return zero_grad(*args, **kwargs)

    t.policy.optimizer.zero_grad = stop_at_first_update
    with pytest.raises(Aborted):
        t.train_step(groups)
    assert t.policy.step == 0 and t.policy.kl_ctrl.value == beta and t.policy.scheduler.last_epoch == 0
    t.policy.optimizer.zero_grad = zero_grad
    t.abort.clear()
    step = t.policy.optimizer.step

    def step_then_stop(*args, **kwargs):
        out = step(*args, **kwargs)
        t.abort.set()
        return out

    t.policy.optimizer.step = step_then_stop
    t.train_step(groups)
    assert t.policy.step == 1 and t.policy.scheduler.last_epoch == 2 and t.policy.kl_ctrl.value != beta
