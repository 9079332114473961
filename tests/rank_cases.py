"""The learner options the rank tests compare between one rank and a group of two."""

from __future__ import annotations

# 4 groups of 4 samples, 4 sequences per micro-batch: one rank and each of two ranks cut the
# batch into the same micro-batches (a metric is a token-weighted mean of micro-batch values,
# which for some losses depends on the cut; the gradient does not: tests/test_learner.py), so
# what differs is the order of sums only. No gradient clipping: the gradient is compared.
BASE = ["learner.lr=1e-2", "algorithm.n=4", "learner.groups_per_step=4", "sampler.max_tokens=6",
        "learner.micro_batch_size=4", "learner.max_grad_norm=1e9"]
CASES = {
    # every loss aggregation mode
    "token-mean": ["algorithm.loss_agg_mode=token-mean"],
    "token-sum": ["algorithm.loss_agg_mode=token-sum"],
    "seq-mean-token-sum": ["algorithm.loss_agg_mode=seq-mean-token-sum"],
    "seq-mean-token-mean": ["algorithm.loss_agg_mode=seq-mean-token-mean"],
    "seq-mean-token-sum-norm": ["algorithm.loss_agg_mode=seq-mean-token-sum-norm"],
    # what else is batch-wide or counts across the batch
    "geo_mean": ["algorithm.policy_loss=geo_mean"],  # divides by the mini-batch's rows
    "epochs_minibatches": ["learner.ppo_epochs=2", "learner.ppo_mini_batches=2"],
    "optimal_token_baseline": ["algorithm.adv_estimator=optimal_token_baseline"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],  # batch whitening
    "kl_loss_entropy": ["algorithm.use_kl_loss=true", "algorithm.entropy_coeff=0.01"],
    "rejection_normalized": ["algorithm.correction.is_level=sequence",
                             "algorithm.correction.normalize_weights=true",
                             "algorithm.correction.rollout_rs=seq_max_k3",
                             "algorithm.correction.rollout_rs_threshold=0.05"],
    "bypass_mode": ["algorithm.correction.mode=bypass", "algorithm.policy_loss=bypass_mode",
                    "algorithm.correction.loss_type=reinforce"],
    "gae": ["algorithm.adv_estimator=gae", "algorithm.adv_estimator.lam=0.9"],
    # a token budget that cuts rank 0's share into 3 micro-batches and rank 1's into 4: rank 0
    # splits one more (every rank runs as many forward passes); the padded path beside it
    "token_budget": ["learner.max_tokens_per_micro_batch=84"],
    "token_budget_padded": ["learner.max_tokens_per_micro_batch=84", "learner.packing=false"],
}
# FSDP2 as on a GPU: parameters freed after each forward, gradients reduced every micro-batch
GPU_STYLE = {f"{name}-resharded": [*CASES[name], "learner.reshard_after_forward=true"]
             for name in ("token-mean", "epochs_minibatches", "gae")}
BF16 = {"token-mean-bf16": ["algorithm.loss_agg_mode=token-mean", "learner.dtype=bfloat16"]}
# LoRA on the group (base frozen): a step, then a checkpoint (``lora``); a step after resuming
# a one-rank checkpoint the test wrote into ``run-lora-resume`` (``lora-resume``)
LORA = {"lora": ["learner.lora.rank=4", "learner.lora.alpha=32"],
        "lora-resume": ["learner.lora.rank=4", "learner.lora.alpha=32", "learner.resume=true"]}
