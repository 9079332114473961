"""The learner's step in-process on the tiny model: invariances and every option combination."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from actors.data.chat import chat_ids
from actors.learner.trainer import Trainer
from actors.runtime.tensors import to_wire
from messages.rollout import ChatMessage, Prompt, Sample, ScoredGroup
from tests.learner_cases import OPTIONS, SAMPLING, make_trainer, with_behaviour


def make_groups(trainer: Trainer, *, seed: int = 0, behaviour_offset: float = 0.0,
                version: int = 0, n_groups: int = 2) -> list[ScoredGroup]:
    """``n_groups`` groups of four random responses; behaviour log-probs are the model's own
    (+ offset).

    Every sample of three tokens or more has a tool token in the middle (``loss_mask`` 0), and
    carries two reward components in ``reward_extra`` (``format``, ``acc``) for gdpo.
    """
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(n_groups):
        prompt_ids = torch.tensor(chat_ids(trainer.policy.tokenizer,
                                           [ChatMessage("user", f"say {'abcd'[g % 4]}")]),
                                  dtype=torch.int32)
        samples = []
        for i in range(4):
            resp = torch.randint(3, 30, (2 + (i + g) % 5,), generator=gen, dtype=torch.int32)
            loss_mask = torch.ones(len(resp), dtype=torch.int8)
            if len(resp) >= 3:
                loss_mask[len(resp) // 2] = 0  # a tool token inside the response
            reward = float((i + g) % 3 == 0)
            samples.append(Sample(to_wire(resp), to_wire(torch.zeros(len(resp))), version,
                                  "", "stop" if i % 2 else "length", reward=reward,
                                  loss_mask=to_wire(loss_mask),
                                  reward_extra={"format": float(i % 2), "acc": reward}))
        prompt = Prompt(g, [ChatMessage("user", "x")], "repeat_letter", "a")
        groups.append(ScoredGroup(prompt, to_wire(prompt_ids), samples, "s", baseline_reward=0.5,
                                  sampling=SAMPLING))
    # the behaviour log-probs: the current policy's (optionally shifted)
    return with_behaviour(trainer, groups, lambda s, own: own + behaviour_offset)


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.snapshot()}


def test_is_weights_are_one_when_behaviour_is_the_policy(tiny_model, tmp_path):
    t = make_trainer(tiny_model, tmp_path)
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


MICRO_BATCH_CASES = {
    "token-mean": ["algorithm.loss_agg_mode=token-mean"],
    "seq-mean-token-mean": ["algorithm.loss_agg_mode=seq-mean-token-mean"],
    "seq-mean-token-sum": ["algorithm.loss_agg_mode=seq-mean-token-sum"],
    "token-sum": ["algorithm.loss_agg_mode=token-sum"],
    "geo_mean": ["algorithm.policy_loss=geo_mean"],  # divides by the mini-batch's rows
    "optimal_token_baseline": ["algorithm.adv_estimator=optimal_token_baseline"],
    "bypass_mode": ["algorithm.correction.mode=bypass", "algorithm.policy_loss=bypass_mode",
                    "algorithm.correction.loss_type=reinforce",
                    "algorithm.correction.rollout_rs=token_k3", "algorithm.correction.rollout_rs_threshold=1.0"],
}


@pytest.mark.parametrize("case", list(MICRO_BATCH_CASES))
def test_micro_batch_size_does_not_change_the_gradient(tiny_model, tmp_path, case):
    """Losses aggregate over the whole mini-batch, so accumulation over micro-batches is exact."""
    opts = MICRO_BATCH_CASES[case]
    a = make_trainer(tiny_model, tmp_path / "a", "learner.micro_batch_size=8", "learner.max_grad_norm=1e9", *opts)
    b = make_trainer(tiny_model, tmp_path / "b", "learner.micro_batch_size=3", "learner.max_grad_norm=1e9", *opts)
    ga, gb = captured_gradients(a), captured_gradients(b)
    groups = make_groups(a, behaviour_offset=-0.3)
    a.train_step(groups)
    b.train_step(groups)
    scale = max(float(g.abs().max()) for g in ga.values())
    worst = max(float((ga[k] - gb[k]).abs().max()) for k in ga)
    assert scale > 1e-4 and worst < 1e-5 * scale, (worst, scale)


REACHES = {
    "gdpo": "gdpo/format/mean",
    "bypass_mode_ppo_clip": "rollout_corr/rollout_rs_token_k1_mean",
    "kl_plus": "actor/kl_loss",
    "rejection_seq_sum_max": "rollout_corr/rollout_rs_seq_max_k3_mean",
    "rollout_rs_strings": "rollout_corr/rollout_rs_seq_sum_k3_mean",
    "icepop": "rollout_corr/rollout_is_oob_ratio",
    "icepop_sequence_rejection": "rollout_corr/rollout_rs_token_k3_mean",
}
NEW_NAMES = list(OPTIONS)[list(OPTIONS).index("gpg"):]


@pytest.fixture(scope="module")
def default_step(tiny_model, tmp_path_factory):
    """The metrics of the default algorithm's step with the given [learner] overrides."""
    done: dict[tuple[str, ...], dict[str, float]] = {}

    def run(*learner: str) -> dict[str, float]:
        if learner not in done:
            t = make_trainer(tiny_model, tmp_path_factory.mktemp("default"), *learner)
            done[learner] = t.train_step(make_groups(t, behaviour_offset=-0.1))
        return done[learner]

    return run


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_option_takes_a_finite_step(tiny_model, tmp_path, name, default_step):
    t = make_trainer(tiny_model, tmp_path, *OPTIONS[name])
    before = params(t)
    m = t.train_step(make_groups(t, behaviour_offset=-0.1))
    bad = {k: v for k, v in m.items() if not math.isfinite(v)}
    assert not bad, bad
    assert t.policy.step == 1
    moved = max(float((before[k] - v).abs().max()) for k, v in params(t).items())
    assert moved > 0, "the step did not change the policy"
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "rollout_corr/is_weight_mean",
                "rollout_corr/kl", "rollout_corr/k3_kl", "staleness/mean"):
        assert key in m
    if name in REACHES:
        assert REACHES[name] in m
    elif name in NEW_NAMES:
        reference = default_step(*(o for o in OPTIONS[name] if o.startswith("learner.")))
        assert m["actor/grad_norm"] != reference["actor/grad_norm"], "the option changed nothing"


def test_a_batch_with_no_token_to_train_is_a_step_that_moves_nothing(tiny_model, tmp_path):
    """Every response masked out (a multi-turn episode whose budget went to the environment's
    first observation before the model wrote): the step is taken, its gradient zero, the
    advantages' extremes nan (there are none), and the weights are as they were."""
    t = make_trainer(tiny_model, tmp_path, "learner.lr=0.1")
    groups = make_groups(t)
    for g in groups:
        for k, smp in enumerate(g.samples):
            g.samples[k] = msgspec.structs.replace(smp, loss_mask=to_wire(
                torch.zeros(smp.loss_mask.shape, dtype=torch.int8)))
    before = params(t)
    m = t.train_step(groups)
    assert m["actor/grad_norm"] == 0.0
    assert math.isnan(m["critic/advantages/max"]) and math.isnan(m["critic/advantages/min"])
    after = params(t)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_lora_snapshot_is_the_merged_base_model(tiny_model, tmp_path):
    t = make_trainer(tiny_model, tmp_path, "learner.lora.rank=4")
    t.train_step(make_groups(t))
    snap = dict(t.policy.snapshot())
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
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
def test_checkpoint_resume_restores_weights_and_step(tiny_model, tmp_path, extra):
    t = make_trainer(tiny_model, tmp_path, *extra)
    t.train_step(make_groups(t))
    t.policy.save_checkpoint()
    r = make_trainer(tiny_model, tmp_path, *extra)
    assert r.policy.step == 1 and r.policy.resumed_from is not None
    assert r.policy.scheduler.get_last_lr() == t.policy.scheduler.get_last_lr()  # bit for bit
    assert [g["lr"] for g in r.policy.optimizer.param_groups] == \
        [g["lr"] for g in t.policy.optimizer.param_groups]
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


def test_a_resume_with_another_learning_rate_trains_with_it(tiny_model, tmp_path):
    """The checkpoint's optimizer and schedule hold the rate they were made with; the
    topology's wins (at the schedule's place the checkpoint holds), for the critic's too."""
    schedule = ["algorithm.adv_estimator=gae", "learner.lr_scheduler=cosine",
                "learner.warmup_steps=1", "learner.total_steps=4"]
    t = make_trainer(tiny_model, tmp_path, *schedule)
    t.train_step(make_groups(t))
    t.train_step(make_groups(t, seed=1))
    t.policy.save_checkpoint()
    r = make_trainer(tiny_model, tmp_path, *schedule, "learner.lr=0.25", "learner.critic_lr=0.5")
    at = r.policy.scheduler.lr_lambdas[0](2)
    assert r.policy.scheduler.last_epoch == 2 and 0 < at < 1
    assert [g["lr"] for g in r.policy.optimizer.param_groups] == [0.25 * at]
    assert r.policy.scheduler.get_last_lr() == [0.25 * at]
    assert [g["lr"] for g in r.policy.critic_optimizer.param_groups] == [0.5]
    r.train_step(make_groups(r, seed=2))
    assert r.policy.scheduler.get_last_lr() == [0.25 * r.policy.scheduler.lr_lambdas[0](3)]


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_a_stop_never_leaves_half_a_step(tiny_model, tmp_path):
    """An abandoned step changes no state (β of the adaptive KL controller included); once it
    has taken an optimizer update it finishes: a stop's checkpoint is a whole step's state."""
    from actors.learner.trainer import Aborted

    t = make_trainer(tiny_model, tmp_path, "learner.ppo_mini_batches=2", "algorithm.use_kl_in_reward=true",
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


def test_gdpo_reads_its_components_from_the_scorers_extras(tiny_model, tmp_path):
    """gdpo's components come from Sample.reward_extra; a failed sample scores 0 on each, and a
    key missing from a scored sample stops the step with the key's name."""
    from actors.learner.batch import reward_components

    t = make_trainer(tiny_model, tmp_path, "algorithm.adv_estimator=gdpo",
                     "algorithm.adv_estimator.gdpo_reward_keys=['format', 'acc']")
    groups = make_groups(t)
    groups[0].samples[0].reward_extra = {}
    groups[0].samples[0].reward_error = "timeout"
    got = reward_components(groups, ["format", "acc"])
    assert got.shape == (2, 8) and got[0, 0] == 0 and got[1, 0] == 0
    assert got[0].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    m = t.train_step(groups)
    assert m["gdpo/format/mean"] == pytest.approx(0.5) and m["gdpo/format/std"] == pytest.approx(0.5)
    groups[1].samples[2].reward_extra = {"format": 1.0}
    with pytest.raises(ValueError, match="gdpo reward key 'acc' is not in the scorer's result of "
                                         "prompt 1 sample 2"):
        reward_components(groups, ["format", "acc"])


def test_a_live_snapshot_on_one_rank_gives_the_parameters_uncopied(tiny_model, tmp_path):
    """The shm transport writes the weights out before the next step: it reads the parameters
    themselves (one copy per publish less); every other sender gets copies."""
    t = make_trainer(tiny_model, tmp_path)
    params = {n: p for n, p in t.policy.model.named_parameters()}
    live, copied = dict(t.policy.snapshot(live=True)), dict(t.policy.snapshot())
    assert sorted(live) == sorted(copied)
    for name, value in live.items():
        assert value.data_ptr() == params[name].data_ptr(), name
        assert copied[name].data_ptr() != params[name].data_ptr() and torch.equal(copied[name], value)
    halves = dict(t.policy.snapshot(torch.bfloat16, live=True))  # another dtype: a cast, a copy
    assert all(v.data_ptr() != params[n].data_ptr() for n, v in halves.items())


def test_an_update_waits_until_the_last_publish_has_read_the_weights(tiny_model, tmp_path):
    """The learner publishes a step's weights beside the next step (``Learner.publish_beside``):
    the next step's forward and backward passes run meanwhile, and each optimizer update, the
    first thing that changes the weights, waits until the publish has read them out."""
    import threading

    t = make_trainer(tiny_model, tmp_path, "learner.ppo_mini_batches=2")
    groups = make_groups(t)
    before = params(t)
    read, waiting, calls = threading.Event(), threading.Event(), []

    def before_update() -> None:
        calls.append(all(torch.equal(v, before[k]) for k, v in params(t).items()))
        waiting.set()
        read.wait()

    t.before_update = before_update
    step = threading.Thread(target=t.train_step, args=(groups,))
    step.start()
    assert waiting.wait(timeout=120)
    assert step.is_alive() and t.policy.step == 0  # held at its first update, nothing changed
    assert all(torch.equal(v, before[k]) for k, v in params(t).items())
    read.set()
    step.join(timeout=120)
    assert not step.is_alive() and t.policy.step == 1
    assert calls == [True, False]  # once per update: the second after the first has moved them
    assert not all(torch.equal(v, before[k]) for k, v in params(t).items())
