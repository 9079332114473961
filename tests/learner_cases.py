"""Shared by the learner tests: a trainer on the tiny model, and every option worth a step."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from actors.job.config.load import apply_overrides, decode_topology
from actors.learner.batch import build_batch
from actors.learner.objective import response_logprobs
from actors.learner.trainer import Trainer
from actors.runtime.config.estimators import ROWS as ESTIMATORS
from actors.runtime.config.losses import ROWS as LOSSES
from actors.runtime.tensors import to_wire
from messages.rollout import SamplingParams, ScoredGroup

SAMPLING = SamplingParams(temperature=1.0, max_tokens=6)  # what the test groups were sampled with


def make_trainer(model: Path, run_dir: Path, *overrides: str) -> Trainer:
    topo = decode_topology(apply_overrides({}, [f"model.path={model}", "learner.lr=1e-2",
                                                "algorithm.n=4", "learner.groups_per_step=2",
                                                "sampler.max_tokens=6", *overrides]))
    return Trainer(topo, run_dir)


def with_behaviour(trainer: Trainer, groups: list[ScoredGroup], behaviour) -> list[ScoredGroup]:
    """``groups`` with each sample's behaviour log-probs set to ``behaviour(sample, own)``, where
    ``own`` is the sample's response log-probs under the trainer's current policy."""
    batch = build_batch(groups, trainer.policy.pad_id, trainer.policy.processor)
    with torch.no_grad():
        lp = response_logprobs(trainer.policy.model, batch, SAMPLING.temperature)
    out, row = [], 0
    for g in groups:
        start = g.prompt_ids.shape[0] - 1
        samples = []
        for s in g.samples:
            own = lp[row, start:start + s.response_ids.shape[0]]
            samples.append(msgspec.structs.replace(
                s, behaviour_logprobs=to_wire(behaviour(s, own))))
            row += 1
        out.append(msgspec.structs.replace(g, samples=samples))
    return out


OPTIONS = {
    "grpo": [],
    "dr_grpo": ["algorithm.adv_estimator=dr_grpo"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_pp": ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.adv_estimator.gamma=0.9"],
    "reinforce_pp_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "remax": ["algorithm.adv_estimator=remax"],
    "gae": ["algorithm.adv_estimator=gae", "algorithm.adv_estimator.lam=0.9"],
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
    # every further name verl 0.9.1 has beyond the above
    "gpg": ["algorithm.adv_estimator=gpg", "algorithm.policy_loss=gpg"],
    "optimal_token_baseline": ["algorithm.adv_estimator=optimal_token_baseline"],
    "tir_optimal_token_baseline": ["algorithm.adv_estimator=tir_optimal_token_baseline",
                                   "algorithm.correction.is_level=sequence"],
    "gdpo": ["algorithm.adv_estimator=gdpo", "algorithm.adv_estimator.gdpo_reward_keys=['format', 'acc']",
             "algorithm.adv_estimator.gdpo_reward_weights=[0.5, 1.0]"],
    # on-policy these losses have PPO's gradient: a second epoch makes the step off-policy
    "sapo": ["algorithm.policy_loss=sapo", "algorithm.loss_agg_mode=seq-mean-token-mean",
             "algorithm.policy_loss.tau_pos=1.0", "algorithm.policy_loss.tau_neg=1.05", "learner.ppo_epochs=2"],
    "geo_mean": ["algorithm.policy_loss=geo_mean", "algorithm.clip_ratio_low=0.4",
                 "algorithm.clip_ratio_high=0.4", "learner.micro_batch_size=3"],
    "clip_cov": ["algorithm.policy_loss=clip_cov", "algorithm.policy_loss.clip_cov_ratio=0.2",
                 "algorithm.policy_loss.clip_cov_lb=-10.0", "algorithm.policy_loss.clip_cov_ub=10.0",
                 "learner.ppo_epochs=2"],
    "kl_cov": ["algorithm.policy_loss=kl_cov", "algorithm.policy_loss.kl_cov_ratio=0.2",
               "algorithm.policy_loss.ppo_kl_coef=0.1", "learner.ppo_epochs=2"],
    "dppo_tv": ["algorithm.policy_loss=dppo_tv", "algorithm.clip_ratio_low=0.01",
                "algorithm.clip_ratio_high=0.01", "learner.ppo_epochs=2"],
    "dppo_kl": ["algorithm.policy_loss=dppo_kl", "algorithm.clip_ratio_c=0",
                "algorithm.clip_ratio_low=0.001", "algorithm.clip_ratio_high=0.001",
                "learner.ppo_epochs=2"],
    "dro": ["algorithm.policy_loss=dro", "algorithm.policy_loss.dro_beta=0.1", "learner.ppo_epochs=2"],
    "bypass_mode_ppo_clip": ["algorithm.correction.mode=bypass", "algorithm.policy_loss=bypass_mode",
                             "algorithm.correction.rollout_rs=token_k1,seq_max_k3",
                             "algorithm.correction.rollout_rs_threshold='0.1_10.0,5.0'"],
    "bypass_mode_reinforce": ["algorithm.correction.mode=bypass",
                              "algorithm.policy_loss=bypass_mode",
                              "algorithm.correction.loss_type=reinforce",
                              "algorithm.correction.is_level=sequence",
                              "algorithm.correction.normalize_weights=true"],
    "kl_plus": ["algorithm.use_kl_loss=true", "algorithm.kl_loss_type=k3+",
                "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=low_var_kl+"],
    "token_sum": ["algorithm.loss_agg_mode=token-sum", "learner.lr=1e-4"],
    "rejection_seq_sum_max": ["algorithm.correction.rejection=[{statistic='k2', level='sequence', high=5.0, reduce='sum'}, {statistic='k3', level='sequence', high=5.0, reduce='max'}]"],
    "rollout_rs_strings": ["algorithm.correction.rollout_rs=seq_sum_k2,seq_max_k2,seq_sum_k3,seq_max_k3",
                           "algorithm.correction.rollout_rs_threshold=5.0"],
    "icepop": ["algorithm.correction.is_low=0.5", "algorithm.correction.is_cap=2.0"],
    "icepop_sequence_rejection": ["algorithm.correction.is_level=sequence",
                                  "algorithm.correction.is_low=0.1",
                                  "algorithm.correction.is_cap=10.0",
                                  "algorithm.correction.rejection=[{statistic='k3', level='token', high=0.5}]"],
}

# a row no case above chooses (and not the default's, nor a user's own, tested on its own) by
# its name alone: a variant whose options all have defaults needs no line here to take a step
# (and a job, if its traits change what the actors do: tests/test_variants_job.py); one that
# needs an option gets a case above. A loss takes two epochs: on-policy most losses have PPO's
# gradient, the second epoch is off-policy
for _key, _rows, _more in (("adv_estimator", ESTIMATORS, []),
                           ("policy_loss", LOSSES, ["learner.ppo_epochs=2"])):
    for _name, _row in _rows.items():
        _chosen = any(f"algorithm.{_key}={_name}" in o for o in OPTIONS.values())
        if not _chosen and _row not in (ESTIMATORS["grpo"], LOSSES["vanilla"], _rows["custom"]):
            OPTIONS[_name] = [f"algorithm.{_key}={_name}", *_more]


# Proof that an option reaches the step: a metric only it produces, or else a gradient that
# differs from the default algorithm's on the same batch with the same [learner] settings.
