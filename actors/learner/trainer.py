"""The learner's training step: synchronous torch code that the actor runs in a worker thread.

The models and their state are ``actors/learner/policy.py``'s. A step trains on one batch of scored groups (a policy version): it computes what the chosen
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
- ``bypass``: the sampler's behaviour log-probs are the PPO old log-probs. With the
  ``bypass_mode`` loss, the loss weights and rejects against μ itself (verl's bypass mode).

The correction (IS weights, rejection, ``rollout_corr/`` metrics) is verl's pipeline,
``kernels.rollout_corr.rollout_correction``, on the original response mask. The step's
``rollout_corr/`` metrics compare μ with π_old (decoupled) or, in bypass mode, with the policy of
the first epoch's forward passes.

With several ranks (``actors/learner/distributed.py``) every rank builds the whole batch and
computes what is batch-wide on its share of the rows (the no-grad passes); the per-token results
are summed over ranks (each row is filled by one rank, zeros elsewhere), so advantages and the
correction are computed on the whole batch by every rank, exactly as by one. Each mini-batch is
split into equal contiguous parts of whole groups, one per rank; losses are divided by the
mini-batch's global token and sequence counts (every rank holds the whole batch's masks, so they
need no all-reduce), and FSDP sums the gradients over ranks: every ``loss_agg_mode`` is exact.
The abort check is a collective too, so all ranks abandon a step at the same micro-batch.

The optimal token baselines need π_old's ``sum_pi_squared`` (the sum over the vocabulary of π²
per token), computed in the same no-grad pass as the proximal log-probs; gdpo reads its reward
components from each sample's ``reward_extra`` (the scorer's result dict).

Log-probs are computed at the temperature the batch was sampled with (``ScoredGroup.sampling``),
and ``seq-mean-token-sum-norm`` divides by its ``max_tokens``: the learner reads how a batch was
generated from the batch, never from the sampler's config.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch

from actors.learner.batch import RolloutBatch, build_batch, reward_components
from actors.learner.critic import critic_values
from actors.learner.distributed import Group, sync_gradients
from actors.learner.objective import (
    Correction,
    correction,
    correction_options,
    critic_loss,
    micro_batch_loss,
    rejection_rules,
    response_logprobs,
)
from actors.learner.packing import micro_batches, micro_limits, refine
from actors.learner.perf import StepTimes, perf_metrics, vision_flops, vision_tower
from actors.learner.policy import Policy
from actors.learner.turns import agent_metrics
from actors.runtime.config import Topology
from actors.runtime.config.algorithm import OPTIMAL_TOKEN_BASELINES
from actors.runtime.versions import staleness
from kernels.advantages import compute_advantages
from kernels.distill import distill_advantages, reverse_kl_metrics
from kernels.kl import kl_estimate
from kernels.offpolicy import weight_metrics
from kernels.rollout_corr import rollout_correction
from kernels.staleness import staleness_histogram
from messages.rollout import SamplingParams, ScoredGroup


class Aborted(Exception):
    """The step was abandoned because the actor is stopping (no optimizer step was taken)."""


def batch_sampling(groups: list[ScoredGroup]) -> SamplingParams:
    """The sampling parameters every group of a batch was generated with (they must agree: the
    log-probs of a batch are recomputed at one temperature)."""
    found = {g.sampling for g in groups}
    if None in found:
        raise ValueError("a group without its sampling parameters (ScoredGroup.sampling); "
                         "recordings made before groups carried them are read through "
                         "actors/offline/recorded.py, which fills them in")
    if len(found) != 1:
        raise ValueError(f"the groups of one batch were sampled with different parameters: "
                         f"{sorted(map(str, found))}")
    return found.pop()


class Trainer:
    """The training step over a ``Policy``: advantages, correction, optimizer updates, metrics.

    ``checkpoint`` is ``Policy``'s (``"latest"``, a ``step_N`` directory, or ``None``).
    """

    def __init__(self, topology: Topology, run_dir: Path,
                 checkpoint: Path | Literal["latest"] | None = "latest",
                 group: Group | None = None) -> None:
        self.topo, self.cfg, self.algo = topology, topology.learner, topology.algorithm
        self.policy = Policy(topology, run_dir, checkpoint, group)
        self.group = self.policy.group
        self.abort = threading.Event()
        self._updated = False  # this step has taken an optimizer update (it can no longer abort)
        # called once, before the first step's forward, with its largest micro-batch's tokens
        # and the most image patches a micro-batch of it holds
        self.on_first_batch: Callable[[int, int], None] | None = None
        self.vision_tower = vision_tower(self.policy.model)  # None: a text model

    def _micro_slices(self, lengths: list[int], lo: int, hi: int) -> list[slice]:
        """This rank's micro-batches of rows ``[lo, hi)``: its share is an equal contiguous part,
        one per rank (the config check makes them whole groups), cut by ``micro_batch_size`` and
        the token budget (``actors/learner/packing.py``) into as many micro-batches as any rank's
        share needs, so that every rank runs as many forward passes."""
        part = (hi - lo) // self.group.world
        rows, tokens = micro_limits(self.cfg, self.policy.device.type == "cuda")
        splits = [micro_batches(lengths, lo + r * part, lo + (r + 1) * part, rows, tokens)
                  for r in range(self.group.world)]
        return refine(splits[self.group.rank], lengths, max(map(len, splits)))

    def _check_abort(self) -> None:
        # once an update is taken the step is finished: an abandoned step changes no state, so
        # a stop's checkpoint of step k is exactly the state after step k (an offline rerun);
        # with ranks, rank 0's stop is every rank's (they decide at the same check)
        if not self._updated and self.group.any(self.abort.is_set()):
            self.policy.optimizer.zero_grad(set_to_none=True)
            raise Aborted

    # -- one training step -----------------------------------------------------------------------

    def step_seed(self) -> int:
        """The RNG seed of the next step: a function of the run seed and the step only, so a
        step draws the same numbers (dropout) live, after a resume and in an offline rerun."""
        return self.topo.run.seed * 1_000_003 + self.policy.step

    def train_step(self, groups: list[ScoredGroup],
                   trace: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step on ``groups``; returns its metrics.

        ``trace`` (the offline rerun's hook): when a dict is given, it is filled with the step's
        per-token tensors, each (N, W-1) with rows in batch order (``group_sizes[g]`` rows
        for group g): ``input_ids`` (N, W), ``mask``, ``keep`` (after rejection), ``advantages``,
        ``behaviour_logprobs``, ``old_logprobs`` (proximal), ``current_logprobs`` (π_θ in
        the first epoch's forward) and ``is_weights``. Left ``None``, nothing extra is kept.
        """
        started = time.monotonic()
        times = StepTimes(self.policy.device)
        times.begin("prepare")  # the batch's arrival to the first forward
        torch.manual_seed(self.step_seed())
        self._updated = False
        algo, cfg = self.algo, self.cfg
        sampling = batch_sampling(groups)
        temp = sampling.temperature
        trained_at = self.policy.version  # the weights this step starts from
        batch = build_batch(groups, self.policy.pad_id, self.policy.processor).to(self.policy.device)
        if self.group.world > 1 and not isinstance(batch.group_size, int):
            raise ValueError(f"groups of unequal size {batch.group_sizes} need one learner rank "
                             "(agent.rollout.branches)")
        batch.packed = cfg.packing
        lengths = batch.attention_mask.sum(1).tolist()  # tokens of each row
        N, mask = batch.size, batch.response_mask
        if self.on_first_batch is not None:  # the micro-batches' size is known from here
            slices = self._micro_slices(lengths, 0, N)
            self.on_first_batch(max(sum(lengths[s]) for s in slices),
                                max(batch.vision.patches(s) for s in slices) if batch.vision else 0)
            self.on_first_batch = None
        c = algo.correction
        otb = algo.adv_estimator in OPTIMAL_TOKEN_BASELINES  # needs π_old before advantages
        inline_old = (c.mode == "decoupled" and cfg.ppo_epochs == 1 and cfg.ppo_mini_batches == 1
                      and not rejection_rules(algo) and not c.normalize_weights
                      and not algo.use_kl_in_reward and not otb)
        need_old = c.mode == "decoupled" and not inline_old
        need_ref = algo.use_kl_loss or algo.use_kl_in_reward

        times.end("prepare")
        # batch-wide quantities, computed with the weights of the start of the step
        old = batch.behaviour_logprobs.clone() if c.mode == "bypass" else torch.zeros_like(mask)
        sum_pi_sq = torch.zeros_like(mask) if otb else None
        ref = torch.zeros_like(mask) if need_ref else None
        values = torch.zeros_like(mask) if self.policy.critic is not None else None
        with torch.no_grad():
            for s in self._micro_slices(lengths, 0, N):
                self._check_abort()
                mb = batch.rows(s)
                w = mb.response_mask.shape[1]
                if sum_pi_sq is not None:
                    with times("old_log_prob"):
                        old[s, :w], sum_pi_sq[s, :w] = response_logprobs(
                            self.policy.model, mb, temp, with_sum_pi_squared=True)
                elif need_old:
                    with times("old_log_prob"):
                        old[s, :w] = response_logprobs(self.policy.model, mb, temp)
                if need_ref:
                    with times("ref"):
                        ref[s, :w] = self.policy.reference_logprobs(mb, temp)
                if values is not None:
                    with times("values"):
                        values[s, :w] = critic_values(self.policy.critic, mb) * mb.response_mask
        for shared in (old if need_old or otb else None, sum_pi_sq, ref, values):
            if shared is not None:
                self.group.sum_(shared)  # each row from the rank that computed it

        metrics: dict[str, float] = {}
        times.begin("adv")
        rewards = batch.token_rewards
        if algo.use_kl_in_reward:
            source = old if c.mode == "decoupled" else batch.behaviour_logprobs
            kl = kl_estimate(source, ref, algo.kl_penalty) * mask  # (N, W-1)
            rewards = rewards - self.policy.kl_ctrl.value * kl
            seq_kl = float((kl.sum(1) / mask.sum(1).clamp_min(1)).mean())
            metrics.update({"actor/reward_kl_penalty": seq_kl, "actor/reward_kl_penalty_coeff":
                            self.policy.kl_ctrl.value})
        batch_corr = correction(algo, old, batch.behaviour_logprobs, mask) if need_old else None
        inputs = {}  # what the chosen estimator needs beyond the rewards
        if otb:
            inputs = dict(old_logprobs=old, sum_pi_squared=sum_pi_sq,
                          is_weights=batch_corr.weights if batch_corr is not None else None)
        elif algo.adv_estimator == "gdpo":
            components = reward_components(groups, algo.gdpo_reward_keys).to(mask.device)
            inputs = dict(reward_components=components,
                          reward_weights=algo.gdpo_reward_weights or None)
            metrics.update(_gdpo_metrics(algo.gdpo_reward_keys, components))
        advantages, returns = compute_advantages(
            algo.adv_estimator, rewards, mask, group_size=batch.group_size, values=values,
            gamma=algo.gamma, lam=algo.lam, reward_baselines=batch.baseline_rewards,
            norm_adv_by_std=algo.norm_adv_by_std_in_grpo, **inputs)
        if self.topo.teacher.path:  # on-policy distillation (kernels/distill.py)
            advantages, distill_metrics = distill(self.topo.teacher, batch, advantages)
            metrics.update(distill_metrics)
        times.end("adv")  # the advantages are on the policy's device: synchronised like the rest

        # optimizer updates: mini-batches hold whole groups
        groups_per_mb = math.ceil(len(groups) / cfg.ppo_mini_batches)
        starts = [0, *itertools.accumulate(batch.group_sizes)]  # each group's first row
        bounds = [(starts[g], starts[min(len(groups), g + groups_per_mb)])
                  for g in range(0, len(groups), groups_per_mb)]
        norm_constant = algo.loss_scale_factor or float(sampling.max_tokens)
        sums: dict[str, float] = {}
        tokens_seen = 0.0
        grad_norms, critic_sums = [], {}
        old_seen = torch.zeros_like(mask)  # the PPO old log-probs used
        current = torch.zeros_like(mask)  # π_θ in the first epoch's forward passes
        times.begin("update_actor")  # the critic's share is moved to update_critic below
        for epoch in range(cfg.ppo_epochs):
            for lo, hi in bounds:
                keep_mb = batch_corr.keep[lo:hi] if batch_corr is not None else mask[lo:hi]
                token_count = float(keep_mb.sum())
                self.policy.optimizer.zero_grad(set_to_none=True)
                micro = self._micro_slices(lengths, lo, hi)
                for s in micro:
                    self._check_abort()
                    for module in (self.policy.model, self.policy.critic):
                        if self.policy.keep_gathered:
                            sync_gradients(module, last=s is micro[-1])
                    mb = batch.rows(s)
                    w = mb.response_mask.shape[1]
                    lp, entropy = response_logprobs(self.policy.model, mb, temp, with_entropy=True)
                    if inline_old:
                        old_mb = lp.detach()
                        corr = correction(algo, old_mb, mb.behaviour_logprobs, mb.response_mask)
                    else:
                        old_mb = old[s, :w]
                        corr = (correction(algo, old_mb, mb.behaviour_logprobs, mb.response_mask)
                                if batch_corr is None else _rows(batch_corr, s, w))
                    old_seen[s, :w] = old_mb
                    if epoch == 0:
                        current[s, :w] = lp.detach()
                    loss, m = micro_batch_loss(
                        algo, lp, entropy, mb, advantages[s, :w], old_mb, corr,
                        ref[s, :w] if ref is not None else None, token_count=token_count,
                        seq_count=hi - lo, norm_constant=norm_constant)
                    loss.backward()
                    n_tok = corr.keep.sum().double()  # (on the device: read once per step)
                    tokens_seen = tokens_seen + n_tok
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + v * n_tok
                    if self.policy.critic is not None:
                        with times("update_critic"):
                            v_new = critic_values(self.policy.critic, mb)
                            vloss, vm = critic_loss(algo, v_new, values[s, :w], returns[s, :w],
                                                    mb.response_mask, token_count=token_count,
                                                    seq_count=hi - lo)
                            vloss.backward()
                        for k, v in vm.items():
                            critic_sums[k] = critic_sums.get(k, 0.0) + v * n_tok
                self._check_abort()
                grad_norms.append(_full(torch.nn.utils.clip_grad_norm_(
                    [p for p in self.policy.model.parameters() if p.requires_grad], cfg.max_grad_norm)))
                self.policy.optimizer.step()
                self._updated = True
                self.policy.scheduler.step()
                if self.policy.critic is not None:
                    with times("update_critic"):
                        torch.nn.utils.clip_grad_norm_(self.policy.critic.parameters(),
                                                       cfg.max_grad_norm)
                        self.policy.critic_optimizer.step()
                        self.policy.critic_optimizer.zero_grad(set_to_none=True)
        times.end("update_actor")
        times.seconds["update_actor"] -= times.seconds.get("update_critic", 0.0)
        self.policy.optimizer.zero_grad(set_to_none=True)
        self.policy.step += 1
        if algo.use_kl_in_reward:  # after the step: an abandoned step leaves β as it was
            self.policy.kl_ctrl.update(seq_kl, N)

        summed = {**sums, **critic_sums}
        names = list(summed)  # the same on every rank: the same code ran on each
        # the step's one read of its per-micro-batch sums and norms from the device
        local = _floats([tokens_seen, *(summed[k] for k in names), *grad_norms])
        grad_norms = local[len(local) - len(grad_norms):]
        tokens_seen, *values_summed = self.group.sum_floats(local[:len(local) - len(grad_norms)])
        metrics.update({k: v / max(tokens_seen, 1.0) for k, v in zip(names, values_summed, strict=True)})
        self.group.sum_(old_seen)  # each row from the rank that trained on it
        self.group.sum_(current)
        probe, final, weights = self._final_correction(batch, old_seen, current)
        metrics.update(final.metrics)
        metrics.update(weight_metrics(probe, batch.behaviour_logprobs, final.keep, weights))
        metrics.update(staleness_histogram(staleness(trained_at, batch.versions)))
        metrics.update(token_staleness(trained_at, batch, mask))
        metrics["timing_s/weight_sync"] = sum(g.weight_sync_s for g in groups)
        if self.topo.teacher.path:  # the teacher's slowest answer among the batch's groups
            metrics["timing_s/teacher"] = max(g.teacher_seconds for g in groups)
        # the sampler's side: its longest generation call among the batch's groups (a call
        # generates a request's prompts together); in async mode it overlaps the learner's step
        metrics["timing_s/gen"] = max(g.generate_seconds for g in groups)
        metrics.update(times.metrics())
        # a vision-language model: its language model's FLOPs and its vision tower's
        patches = [] if batch.vision is None else batch.vision.image_grid_thw.prod(-1).tolist()
        metrics.update(perf_metrics(self.policy.model.config.get_text_config(), self.policy.device,
                                    lengths, cfg.ppo_epochs, times.seconds["update_actor"],
                                    self.group.world, vision_flops(self.vision_tower, patches)))
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
            "actor/lr": self.policy.scheduler.get_last_lr()[0],
            "timing_s/step": elapsed,
            "perf/throughput": float(batch.attention_mask.sum()) / elapsed,
        })
        metrics.update(agent_metrics(groups))  # multi-turn batches only
        if values is not None:
            metrics["critic/values/mean"] = float(values[mask.bool()].mean())
            metrics["critic/returns/mean"] = float(returns[mask.bool()].mean())
        if trace is not None:
            trace.update(input_ids=batch.input_ids, mask=mask, keep=final.keep,
                         advantages=advantages, behaviour_logprobs=batch.behaviour_logprobs,
                         old_logprobs=old_seen, current_logprobs=current, is_weights=weights)
        return metrics

    def _final_correction(self, batch: RolloutBatch, old_seen: torch.Tensor,
                          current: torch.Tensor):
        """The step's correction over the whole batch, whose metrics are the step's
        ``rollout_corr/``: μ against π_old (decoupled) or against π_θ of the first epoch's
        forward passes (bypass, where the loss compares with π_θ). Returns the log-probs μ was
        compared with, ``kernels.rollout_corr.RolloutCorrection``, and the weights the loss
        applied (the kept mask where it applied none)."""
        algo = self.algo
        bypass = algo.correction.mode == "bypass"
        probe = current if bypass else old_seen
        out = rollout_correction(probe, batch.behaviour_logprobs, batch.response_mask,
                                 **correction_options(algo))
        applied = not bypass or (algo.policy_loss == "bypass_mode"
                                 and algo.correction.loss_type == "reinforce")
        return probe, out, out.weights if applied and out.weights is not None else out.keep


def distill(teacher, batch, advantages: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's advantages with the distillation term (``teacher.weight``, ``kl_kind``,
    ``kl_clamp``) added to the task's, or alone (``task_rewards = false``), from the behaviour
    log-probs and the teacher's recorded with each sample; and the reverse-KL metrics."""
    if batch.teacher_logprobs is None:
        raise ValueError("[teacher] is set but a sample of this batch carries no teacher "
                         "log-probs (Sample.teacher_logprobs)")
    adv = distill_advantages(batch.behaviour_logprobs, batch.teacher_logprobs,
                             batch.response_mask, weight=teacher.weight, kind=teacher.kl_kind,
                             kl_clamp=teacher.kl_clamp,
                             task_advantages=advantages if teacher.task_rewards else None)
    return adv.to(advantages.dtype), reverse_kl_metrics(
        batch.behaviour_logprobs, batch.teacher_logprobs, batch.response_mask)


def _gdpo_metrics(keys: list[str], components: torch.Tensor) -> dict[str, float]:
    """verl's ``gdpo/{key}/mean|std|max|min`` of each reward component (K, N), std population."""
    out = {}
    for key, values in zip(keys, components, strict=True):
        out.update({f"gdpo/{key}/mean": float(values.mean()),
                    f"gdpo/{key}/std": float(values.std(correction=0)),
                    f"gdpo/{key}/max": float(values.max()), f"gdpo/{key}/min": float(values.min())})
    return out


def token_staleness(trained_at: int, batch, mask: torch.Tensor) -> dict[str, float]:
    """Staleness of every response token (``staleness_token/*``, the histogram of
    ``staleness/*`` over tokens), and the share of samples whose tokens span more than one
    policy version (weights loaded in flight: ``rollout/multi_version_share``)."""
    if batch.token_versions is None:
        return {}
    on = mask.bool()
    hist = staleness_histogram(staleness(trained_at, batch.token_versions[on]))
    out = {f"staleness_token/{k.split('/', 1)[1]}": v for k, v in hist.items()}
    big = torch.iinfo(torch.long).max
    newest = torch.where(on, batch.token_versions, -big).amax(1)  # (N,)
    oldest = torch.where(on, batch.token_versions, big).amin(1)  # (N,)
    spans = (newest > oldest) & on.any(1)
    out["rollout/multi_version_share"] = float(spans.float().mean())
    return out


def _full(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor (with sharded parameters it is a replicated DTensor)."""
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm


def _floats(values: list[torch.Tensor | float]) -> list[float]:
    """``values`` as floats, the tensors among them read from their device in one copy."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.detach().to(tensors[0].device, torch.float64).reshape(())
                             for t in tensors]).tolist() if tensors else [])
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


def _rows(corr: Correction, s: slice, width: int) -> Correction:
    return Correction(None if corr.weights is None else corr.weights[s, :width], corr.keep[s, :width],
                      corr.metrics)
