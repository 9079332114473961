"""The learner's compute: synchronous torch code that the actor runs in a worker thread.

A step trains on one batch of scored groups (a policy version): it computes what the chosen
algorithm needs over the whole batch first (proximal log-probs, reference log-probs, values),
then advantages, the off-policy correction, and ``ppo_epochs × ppo_mini_batches`` optimizer
updates with gradient accumulation over micro-batches. Losses are aggregated over the whole
mini-batch (a token-mean is a sum over all its tokens divided by their count, not a mean of
micro-batch means).

Off-policy correction (``algorithm.correction``):
- ``decoupled`` (AReaL): PPO on ``π_θ/π_old`` with ``π_old`` the weights at the start of the
  step, each token weighted by ``min(π_old/μ, is_cap)``. With one epoch over one mini-batch and
  nothing needed batch-wide, ``π_old`` equals each micro-batch's own forward (the weights have
  not moved yet), so that forward is the recompute; otherwise a no-grad pass computes it first.
- ``bypass``: the sampler's behaviour log-probs are the PPO old log-probs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.learner.batch import RolloutBatch, build_batch
from actors.learner.checkpoints import (
    PARTIAL_PREFIX,
    STATE_FILE,
    checkpoints,
    latest_checkpoint,
    read_state,
)
from actors.learner.objective import (
    Correction,
    correction,
    critic_loss,
    micro_batch_loss,
    response_logprobs,
)
from actors.runtime.config import Topology
from kernels.advantages import compute_advantages
from kernels.importance import mismatch_metrics, staleness_histogram
from kernels.kl import AdaptiveKLController, FixedKLController, kl_estimate
from messages.rollout import ScoredGroup


class Aborted(Exception):
    """The step was abandoned because the actor is stopping (no optimizer step was taken)."""


def lr_lambda(kind: str, warmup: int, total: int, min_ratio: float):
    """Multiplier of the base learning rate after ``u`` optimizer updates."""
    def at(u: int) -> float:
        if u < warmup:
            return (u + 1) / (warmup + 1)
        if kind == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (u - warmup) / (total - warmup))
        if kind == "linear":
            return 1.0 - (1.0 - min_ratio) * progress
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return at


class Trainer:
    """The learner's state (policy, optimizer, scheduler, KL controller) and its training step.

    ``checkpoint`` says where the state comes from: ``"latest"`` (the run directory's newest
    checkpoint when ``learner.resume`` is set, else the base model), a given ``step_N``
    directory, or ``None`` (the base model with a fresh optimizer: the state before step 1).
    Only ``save_checkpoint`` writes into ``run_dir``.
    """

    def __init__(self, topology: Topology, run_dir: Path,
                 checkpoint: Path | Literal["latest"] | None = "latest") -> None:
        self.topo, self.cfg, self.algo = topology, topology.learner, topology.algorithm
        self.run_dir = run_dir
        self.abort = threading.Event()
        self._updated = False  # this step has taken an optimizer update (it can no longer abort)
        torch.manual_seed(topology.run.seed)
        base = Path(topology.model.path)
        self.dtype = getattr(torch, topology.model.dtype)
        self.step = 0
        state: dict = {}
        if checkpoint == "latest":
            ckpt = latest_checkpoint(run_dir) if self.cfg.resume else None
        else:
            ckpt = checkpoint
        if ckpt is not None:
            state = read_state(ckpt)
            self.step = state["step"]
        self.resumed_from = ckpt
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        self.model = self._load_policy(base, ckpt)
        if self.cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            self.model.config.use_cache = False
        self.model.train()
        updates = self.cfg.total_steps * self.cfg.ppo_epochs * self.cfg.ppo_mini_batches
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.cfg.lr, betas=self.cfg.betas,
                                           weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(
            self.cfg.lr_scheduler, self.cfg.warmup_steps, updates, self.cfg.min_lr_ratio))
        # the reference policy is the initial model; with LoRA it is the base without adapters
        self.ref = None
        if (self.algo.use_kl_loss or self.algo.use_kl_in_reward) and self.cfg.lora.rank == 0:
            self.ref = AutoModelForCausalLM.from_pretrained(base, dtype=self.dtype).eval()
            self.ref.requires_grad_(False)
        self.critic = self.critic_optimizer = None
        if self.algo.adv_estimator == "gae":
            from actors.learner.critic import ValueModel
            source = ckpt / "critic" if ckpt is not None and (ckpt / "critic").is_dir() else base
            self.critic = ValueModel(source, self.dtype)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=self.cfg.critic_lr,
                                                      betas=self.cfg.betas)
        k = self.algo.kl_ctrl
        self.kl_ctrl = (FixedKLController(k.kl_coef) if k.type == "fixed"
                        else AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon))
        if ckpt is not None:
            self._load_training_state(ckpt, state)
        self.saved_step = self.step

    # -- models ---------------------------------------------------------------------------------

    def _load_policy(self, base: Path, ckpt: Path | None):
        lora = self.cfg.lora
        if lora.rank == 0:
            return AutoModelForCausalLM.from_pretrained(ckpt or base, dtype=self.dtype)
        from peft import LoraConfig, PeftModel, get_peft_model
        model = AutoModelForCausalLM.from_pretrained(base, dtype=self.dtype)
        if ckpt is not None:
            return PeftModel.from_pretrained(model, ckpt / "adapter", is_trainable=True)
        return get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                                lora_dropout=lora.dropout,
                                                target_modules=list(lora.target_modules)))

    def _load_training_state(self, ckpt: Path, state: dict) -> None:
        self.optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt"))
        self.scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt"))
        if self.critic_optimizer is not None and (ckpt / "critic_optimizer.pt").is_file():
            self.critic_optimizer.load_state_dict(torch.load(ckpt / "critic_optimizer.pt"))
        self.kl_ctrl.value = state.get("kl_coef", self.kl_ctrl.value)

    @property
    def version(self) -> int:
        """Policy version = learner steps taken since the start of the run."""
        return self.step

    @torch.no_grad()
    def _reference_logprobs(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        if self.ref is not None:
            return response_logprobs(self.ref, batch, temperature)
        with self.model.disable_adapter():  # LoRA: the frozen base is the reference
            return response_logprobs(self.model, batch, temperature)

    def _micro_slices(self, lo: int, hi: int) -> list[slice]:
        size = self.cfg.micro_batch_size
        return [slice(i, min(i + size, hi)) for i in range(lo, hi, size)]

    def _check_abort(self) -> None:
        # once an update is taken the step is finished: an abandoned step changes no state, so
        # a stop's checkpoint of step k is exactly the state after step k (offline replay)
        if self.abort.is_set() and not self._updated:
            self.optimizer.zero_grad(set_to_none=True)
            raise Aborted

    # -- one training step -----------------------------------------------------------------------

    def step_seed(self) -> int:
        """The RNG seed of the next step: a function of the run seed and the step only, so a
        step draws the same numbers (dropout) live, after a resume and in offline replay."""
        return self.topo.run.seed * 1_000_003 + self.step

    def train_step(self, groups: list[ScoredGroup],
                   trace: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step on ``groups``; returns its metrics.

        ``trace`` (offline replay's hook): when a dict is given, it is filled with the step's
        per-token tensors, each (N, W-1) with rows in batch order (``group_size`` rows per
        group): ``input_ids`` (N, W), ``mask``, ``keep`` (after rejection), ``advantages``,
        ``behaviour_logprobs``, ``old_logprobs`` (proximal), ``current_logprobs`` (π_θ in
        the first epoch's forward) and ``is_weights``. Left ``None``, nothing extra is kept.
        """
        started = time.monotonic()
        torch.manual_seed(self.step_seed())
        self._updated = False
        algo, cfg = self.algo, self.cfg
        temp = self.topo.sampler.temperature
        batch = build_batch(groups, self.pad_id)
        N, mask = batch.size, batch.response_mask
        c = algo.correction
        inline_old = (c.mode == "decoupled" and cfg.ppo_epochs == 1 and cfg.ppo_mini_batches == 1
                      and not c.rejection and not c.normalize_weights and not algo.use_kl_in_reward)
        need_old = c.mode == "decoupled" and not inline_old
        need_ref = algo.use_kl_loss or algo.use_kl_in_reward

        # batch-wide quantities, computed with the weights of the start of the step
        old = batch.behaviour_logprobs.clone() if c.mode == "bypass" else torch.zeros_like(mask)
        ref = torch.zeros_like(mask) if need_ref else None
        values = torch.zeros_like(mask) if self.critic is not None else None
        with torch.no_grad():
            for s in self._micro_slices(0, N):
                self._check_abort()
                mb = batch.rows(s)
                w = mb.response_mask.shape[1]
                if need_old:
                    old[s, :w] = response_logprobs(self.model, mb, temp)
                if need_ref:
                    ref[s, :w] = self._reference_logprobs(mb, temp)
                if values is not None:
                    values[s, :w] = self.critic(mb.input_ids, mb.attention_mask) * mb.response_mask

        metrics: dict[str, float] = {}
        rewards = batch.token_rewards
        if algo.use_kl_in_reward:
            source = old if c.mode == "decoupled" else batch.behaviour_logprobs
            kl = kl_estimate(source, ref, algo.kl_penalty) * mask  # (N, W-1)
            rewards = rewards - self.kl_ctrl.value * kl
            seq_kl = float((kl.sum(1) / mask.sum(1).clamp_min(1)).mean())
            metrics.update({"actor/reward_kl_penalty": seq_kl, "actor/reward_kl_penalty_coeff":
                            self.kl_ctrl.value})
        advantages, returns = compute_advantages(
            algo.adv_estimator, rewards, mask, group_size=batch.group_size, values=values,
            gamma=algo.gamma, lam=algo.lam, reward_baselines=batch.baseline_rewards,
            norm_adv_by_std=algo.norm_adv_by_std_in_grpo)
        batch_corr = correction(algo, old, batch.behaviour_logprobs, mask) if need_old else None

        # optimizer updates: mini-batches hold whole groups
        groups_per_mb = math.ceil(len(groups) / cfg.ppo_mini_batches)
        bounds = [(g * batch.group_size, min(N, (g + groups_per_mb) * batch.group_size))
                  for g in range(0, len(groups), groups_per_mb)]
        norm_constant = algo.loss_scale_factor or float(self.topo.sampler.max_tokens)
        sums: dict[str, float] = {}
        tokens_seen = 0.0
        grad_norms, critic_sums = [], {}
        old_seen = torch.zeros_like(mask)  # the proximal log-probs used, for the metrics
        current = torch.zeros_like(mask) if trace is not None else None
        for epoch in range(cfg.ppo_epochs):
            for lo, hi in bounds:
                keep_mb = batch_corr.keep[lo:hi] if batch_corr is not None else mask[lo:hi]
                token_count = float(keep_mb.sum())
                self.optimizer.zero_grad(set_to_none=True)
                for s in self._micro_slices(lo, hi):
                    self._check_abort()
                    mb = batch.rows(s)
                    w = mb.response_mask.shape[1]
                    lp, entropy = response_logprobs(self.model, mb, temp, with_entropy=True)
                    if inline_old:
                        old_mb = lp.detach()
                        corr = correction(algo, old_mb, mb.behaviour_logprobs, mb.response_mask)
                    else:
                        old_mb = old[s, :w]
                        corr = (correction(algo, old_mb, mb.behaviour_logprobs, mb.response_mask)
                                if batch_corr is None else _rows(batch_corr, s, w))
                    old_seen[s, :w] = old_mb
                    if current is not None and epoch == 0:
                        current[s, :w] = lp.detach()
                    loss, m = micro_batch_loss(
                        algo, lp, entropy, mb, advantages[s, :w], old_mb, corr,
                        ref[s, :w] if ref is not None else None, token_count=token_count,
                        seq_count=hi - lo, norm_constant=norm_constant)
                    loss.backward()
                    n_tok = float(corr.keep.sum())
                    tokens_seen += n_tok
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + v * n_tok
                    if self.critic is not None:
                        v_new = self.critic(mb.input_ids, mb.attention_mask)
                        vloss, vm = critic_loss(algo, v_new, values[s, :w], returns[s, :w],
                                                mb.response_mask, token_count=token_count,
                                                seq_count=hi - lo)
                        vloss.backward()
                        for k, v in vm.items():
                            critic_sums[k] = critic_sums.get(k, 0.0) + v * n_tok
                self._check_abort()
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(
                    [p for p in self.model.parameters() if p.requires_grad], cfg.max_grad_norm)))
                self.optimizer.step()
                self._updated = True
                self.scheduler.step()
                if self.critic is not None:
                    torch.nn.utils.clip_grad_norm_(self.critic.parameters(), cfg.max_grad_norm)
                    self.critic_optimizer.step()
                    self.critic_optimizer.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if algo.use_kl_in_reward:  # after the step: an abandoned step leaves β as it was
            self.kl_ctrl.update(seq_kl, N)

        metrics.update({k: v / max(tokens_seen, 1.0) for k, v in {**sums, **critic_sums}.items()})
        final = correction(algo, old_seen, batch.behaviour_logprobs, mask)
        metrics.update(final.metrics)
        weights = final.weights if final.weights is not None else final.keep
        metrics.update(mismatch_metrics(old_seen, batch.behaviour_logprobs, final.keep, weights))
        metrics.update(staleness_histogram(self.version - 1 - batch.versions))
        lengths = mask.sum(1)
        adv_at = advantages[mask.bool()]
        elapsed = time.monotonic() - started
        metrics.update({
            "critic/score/mean": float(batch.scores.mean()), "critic/score/max": float(batch.scores.max()),
            "critic/score/min": float(batch.scores.min()),
            "critic/advantages/mean": float(adv_at.mean()), "critic/advantages/max": float(adv_at.max()),
            "critic/advantages/min": float(adv_at.min()),
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float(batch.truncated.float().mean()),
            "actor/grad_norm": sum(grad_norms) / len(grad_norms),
            "actor/lr": self.scheduler.get_last_lr()[0],
            "timing_s/step": elapsed,
            "perf/throughput": float(batch.attention_mask.sum()) / elapsed,
        })
        if values is not None:
            metrics["critic/values/mean"] = float(values[mask.bool()].mean())
            metrics["critic/returns/mean"] = float(returns[mask.bool()].mean())
        if trace is not None:
            assert current is not None  # filled in the first epoch whenever a trace is asked
            trace.update(input_ids=batch.input_ids, mask=mask, keep=final.keep,
                         advantages=advantages, behaviour_logprobs=batch.behaviour_logprobs,
                         old_logprobs=old_seen, current_logprobs=current, is_weights=weights)
        return metrics

    # -- weights and checkpoints ----------------------------------------------------------------

    def snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """A copy of every policy parameter (tied ones once), LoRA merged, in the base names."""
        if self.cfg.lora.rank == 0:
            return [(name, p.detach().clone()) for name, p in self.model.named_parameters()]
        from peft.tuners.lora import LoraLayer
        merged = {}
        core = self.model.get_base_model()
        with torch.no_grad():
            for name, module in core.named_modules():
                if isinstance(module, LoraLayer):
                    delta = module.get_delta_weight(module.active_adapters[0])
                    merged[f"{name}.weight"] = module.get_base_layer().weight + delta
            out = []
            for name, p in core.named_parameters():
                if "lora_" in name:
                    continue
                clean = name.replace(".base_layer", "")
                out.append((clean, merged.get(clean, p).detach().clone()))
        return out

    def save_checkpoint(self) -> Path:
        """Write an HF-format checkpoint atomically (temp dir, then rename); prune old ones."""
        root = self.run_dir / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step_{self.step}"
        tmp = root / f"{PARTIAL_PREFIX}{self.step}_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        if self.cfg.lora.rank == 0:
            self.model.save_pretrained(tmp)
        else:  # the merged model (loadable with from_pretrained) plus the adapter to resume from
            core = self.model.get_base_model()
            fresh = AutoModelForCausalLM.from_config(core.config, dtype=self.dtype)
            fresh.load_state_dict(dict(self.snapshot()), strict=False)
            fresh.tie_weights()
            fresh.save_pretrained(tmp)
            self.model.save_pretrained(tmp / "adapter")
        self.tokenizer.save_pretrained(tmp)
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
        if self.critic is not None:
            (tmp / "critic").mkdir()
            self.critic.save(tmp / "critic")
            torch.save(self.critic_optimizer.state_dict(), tmp / "critic_optimizer.pt")
        (tmp / STATE_FILE).write_text(json.dumps({"step": self.step, "version": self.version,
                                                  "kl_coef": self.kl_ctrl.value}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.saved_step = self.step
        for _, stale in checkpoints(self.run_dir)[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(stale, ignore_errors=True)
        return final


def _rows(corr: Correction, s: slice, width: int) -> Correction:
    return Correction(None if corr.weights is None else corr.weights[s, :width], corr.keep[s, :width],
                      corr.metrics)
