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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from actors.learner import distributed
from actors.learner.batch import RolloutBatch, build_batch, reward_components
from actors.learner.critic import critic_values
from actors.learner.distributed import Group, sync_gradients
from actors.learner.objective import (
    Correction,
    correction,
    correction_options,
    critic_loss,
    micro_batch_loss,
    response_logprobs,
)
from actors.learner.packing import (
    keep_whole,
    micro_batches,
    micro_limits,
    own_tokens,
    packed_tokens,
    read_lengths,
    refine,
    share_groups,
)
from actors.learner.perf import StepTimes, perf_metrics, vision_flops, vision_tower
from actors.learner.policy import Policy
from actors.learner.turns import agent_metrics
from actors.runtime.config import Topology
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
    if any(g.sampling is None for g in groups):
        raise ValueError("a group without its sampling parameters (ScoredGroup.sampling); "
                         "recordings made before groups carried them are read through "
                         "actors/offline/recorded.py, which fills them in")
    found = {g.sampling for g in groups if g.sampling is not None}
    if len(found) != 1:
        raise ValueError(f"the groups of one batch were sampled with different parameters: "
                         f"{sorted(map(str, found))}")
    return found.pop()


@dataclass
class StepState:
    """One step's working state, filled phase by phase (``Trainer.train_step``'s outline)."""

    groups: list[ScoredGroup]
    batch: RolloutBatch  # on the policy's device
    lengths: list[int]  # tokens of each row
    units: list[tuple[list[int], int]] | None  # the shared-prefix groups (rows, prefix), if any
    sampling: SamplingParams  # how the batch was generated (its temperature, max_tokens)
    times: StepTimes
    trained_at: int  # the weights' version the step starts from
    otb: bool  # an optimal-token-baseline estimator: π_old and Σπ² before the advantages
    inline_old: bool  # π_old is each micro-batch's own first forward (no batch-wide pass)
    need_old: bool  # π_old by a batch-wide no-grad pass
    old: torch.Tensor  # (N, W-1) π_old (bypass: the behaviour log-probs)
    sum_pi_sq: torch.Tensor | None
    ref: torch.Tensor | None  # reference log-probs, with a KL loss or penalty
    values: torch.Tensor | None  # the critic's, with gae
    metrics: dict[str, float] = field(default_factory=dict)
    seq_kl: float = 0.0  # the KL penalty's mean, with use_kl_in_reward
    batch_corr: Correction | None = None  # the batch-wide correction (need_old)
    advantages: torch.Tensor = field(init=False)  # (N, W-1), from the advantages phase on
    returns: torch.Tensor = field(init=False)  # (N, W-1), the estimator's (a critic's targets)
    old_seen: torch.Tensor = field(init=False)  # the PPO old log-probs used
    current: torch.Tensor = field(init=False)  # π_θ in the first epoch's forward passes
    sums: dict = field(default_factory=dict)  # metric -> its token-weighted sum (on the device)
    critic_sums: dict = field(default_factory=dict)
    tokens_seen: torch.Tensor | float = 0.0
    grad_norms: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.old_seen = torch.zeros_like(self.batch.response_mask)
        self.current = torch.zeros_like(self.batch.response_mask)


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
        # called before each optimizer update of the policy (the learner's wait for its last
        # publish to have read the weights it is about to change)
        self.before_update: Callable[[], object] | None = None
        self.vision_tower = vision_tower(self.policy.model)  # None: a text model
        # the loss's and the estimator's code, loaded before the first step: a user's function
        # is read from its file here, once per process (its hash checked against the topology's)
        self.algo.policy_loss.load()
        self.algo.adv_estimator.load()

    def _micro_slices(self, lengths: list[int], lo: int, hi: int,
                      units: list[tuple[list[int], int]] | None = None) -> list[slice]:
        """This rank's micro-batches of rows ``[lo, hi)``: its share is an equal contiguous part,
        one per rank (the config check makes them whole groups), cut by ``micro_batch_size`` and
        the token budget (``actors/learner/packing.py``) into as many micro-batches as any rank's
        share needs, so that every rank runs as many forward passes. A group sharing a prefix
        (``units``) is cut only when it alone is over the budget (on a CPU under ``auto``, over
        twice it: ``keep_whole``): a cut computes its prefix again."""
        return self._rank_splits(lengths, lo, hi, units)[self.group.rank]

    def _rank_splits(self, lengths: list[int], lo: int, hi: int,
                     units: list[tuple[list[int], int]] | None) -> list[list[slice]]:
        """Each rank's micro-batches of its part of rows ``[lo, hi)``, refined to as many as
        the rank needing most has."""
        part = (hi - lo) // self.group.world
        cuda = self.policy.device.type == "cuda"
        rows, tokens = micro_limits(self.cfg, cuda, self.policy.token_activation_bytes)
        keep = keep_whole(self.cfg, cuda, tokens)
        splits = [micro_batches(lengths, lo + r * part, lo + (r + 1) * part, rows, tokens, units,
                                keep) for r in range(self.group.world)]
        count = max(map(len, splits))
        return [refine(split, lengths, count) for split in splits]

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
        torch.manual_seed(self.step_seed())
        self._updated = False
        s = self._prepare(groups)  # the batch on the device; what the algorithm needs of it
        self._batch_wide(s)  # π_old, Σπ², reference log-probs, values: with the step's weights
        self._advantages(s)  # rewards (a KL penalty), the correction, the advantages
        self._updates(s)  # ppo_epochs × ppo_mini_batches optimizer updates
        self.policy.step += 1
        if self.algo.use_kl_in_reward:  # after the step: an abandoned step leaves β as it was
            self.policy.kl_ctrl.update(s.seq_kl, s.batch.size)
        return self._report(s, started, trace)

    def _prepare(self, groups: list[ScoredGroup]) -> StepState:
        """The padded batch on the policy's device and which batch-wide passes the step needs."""
        times = StepTimes(self.policy.device)
        times.begin("prepare")  # the batch's arrival to the first forward
        algo, cfg = self.algo, self.cfg
        sampling = batch_sampling(groups)
        batch = build_batch(groups, self.policy.pad_id, self.policy.processor).to(self.policy.device)
        if self.group.world > 1 and not isinstance(batch.group_size, int):
            raise ValueError(f"groups of unequal size {batch.group_sizes} need one learner rank "
                             "(agent.rollout.branches)")
        batch.packed = cfg.packing
        if not (cfg.packing and cfg.share_prefixes and self.policy.attends_trees):
            batch.shared = ()
        lengths = own_tokens(list(batch.lengths), batch.shared)  # each row's in a packed row
        units = share_groups(list(batch.lengths), batch.shared) if any(batch.shared[1:]) \
            else None
        if self.on_first_batch is not None:  # the micro-batches' size is known from here
            slices = self._micro_slices(lengths, 0, batch.size, units)
            self.on_first_batch(max(packed_tokens(lengths, [s], units) for s in slices),
                                max(batch.vision.patches(s) for s in slices) if batch.vision else 0)
            self.on_first_batch = None
        c = algo.correction
        otb = algo.adv_estimator.old_forward  # needs π_old before advantages
        inline_old = (c.mode == "decoupled" and cfg.ppo_epochs == 1 and cfg.ppo_mini_batches == 1
                      and not c.rejection_rules() and not c.normalize_weights
                      and not algo.use_kl_in_reward and not otb)
        mask = batch.response_mask
        times.end("prepare")
        return StepState(
            groups=groups, batch=batch, lengths=lengths, units=units, sampling=sampling,
            times=times,
            trained_at=self.policy.version, otb=otb, inline_old=inline_old,
            need_old=c.mode == "decoupled" and not inline_old,
            # the batch-wide quantities, filled with the weights of the start of the step
            old=batch.behaviour_logprobs.clone() if c.mode == "bypass" else torch.zeros_like(mask),
            sum_pi_sq=torch.zeros_like(mask) if otb else None,
            ref=torch.zeros_like(mask) if algo.use_kl_loss or algo.use_kl_in_reward else None,
            values=torch.zeros_like(mask) if self.policy.critic is not None else None)

    def _batch_wide(self, s: StepState) -> None:
        """No-grad passes over this rank's micro-batches: π_old (with Σπ² for the optimal
        token baselines), the reference log-probs, the critic's values; summed over ranks."""
        temp, times = s.sampling.temperature, s.times
        with torch.no_grad():
            for sl in self._micro_slices(s.lengths, 0, s.batch.size, s.units):
                self._check_abort()
                mb = s.batch.rows(sl)
                w = mb.response_mask.shape[1]
                if s.sum_pi_sq is not None:
                    with times("old_log_prob"):
                        s.old[sl, :w], s.sum_pi_sq[sl, :w] = response_logprobs(
                            self.policy.model, mb, temp, with_sum_pi_squared=True)
                elif s.need_old:
                    with times("old_log_prob"):
                        s.old[sl, :w] = response_logprobs(self.policy.model, mb, temp)
                if s.ref is not None:
                    with times("ref"):
                        s.ref[sl, :w] = self.policy.reference_logprobs(mb, temp)
                if s.values is not None:
                    with times("values"):
                        s.values[sl, :w] = critic_values(self.policy.critic, mb) * mb.response_mask
        for shared in (s.old if s.need_old or s.otb else None, s.sum_pi_sq, s.ref, s.values):
            if shared is not None:
                self.group.sum_(shared)  # each row from the rank that computed it

    def _advantages(self, s: StepState) -> None:
        """The rewards (less the KL penalty when it is in the reward), the batch's correction
        where it is batch-wide, and the chosen estimator's advantages and returns."""
        algo, batch, mask = self.algo, s.batch, s.batch.response_mask
        s.times.begin("adv")
        rewards = batch.token_rewards
        if algo.use_kl_in_reward:
            source = s.old if algo.correction.mode == "decoupled" else batch.behaviour_logprobs
            kl = kl_estimate(source, s.ref, algo.kl_penalty) * mask  # (N, W-1)
            rewards = rewards - self.policy.kl_ctrl.value * kl
            s.seq_kl = float((kl.sum(1) / mask.sum(1).clamp_min(1)).mean())
            s.metrics.update({"actor/reward_kl_penalty": s.seq_kl,
                              "actor/reward_kl_penalty_coeff": self.policy.kl_ctrl.value})
        s.batch_corr = (correction(algo, s.old, batch.behaviour_logprobs, mask) if s.need_old
                        else None)
        est = algo.adv_estimator
        inputs: dict[str, Any] = {}  # what it needs beyond the rewards (its options: its row's)
        if s.otb:
            inputs.update(old_logprobs=s.old, sum_pi_squared=s.sum_pi_sq,
                          is_weights=s.batch_corr.weights if s.batch_corr is not None else None)
        if keys := est.reward_keys():  # reward components, one per key
            components = reward_components(s.groups, keys).to(mask.device)
            inputs.update(reward_components=components)
            s.metrics.update(_gdpo_metrics(keys, components))
        s.advantages, s.returns = compute_advantages(
            est, rewards, mask, group_size=batch.group_size, values=s.values,
            reward_baselines=batch.baseline_rewards, **inputs)
        if self.topo.teacher.path:  # on-policy distillation (kernels/distill.py)
            s.advantages, distill_metrics = distill(self.topo.teacher, batch, s.advantages)
            s.metrics.update(distill_metrics)
        s.times.end("adv")  # the advantages are on the policy's device: synchronised like the rest

    def _mini_batches(self, s: StepState) -> list[tuple[int, int]]:
        """Each mini-batch's rows ``[lo, hi)``: ``ppo_mini_batches`` parts of whole groups."""
        groups = s.groups
        per = math.ceil(len(groups) / self.cfg.ppo_mini_batches)
        starts = [0, *itertools.accumulate(s.batch.group_sizes)]  # each group's first row
        return [(starts[g], starts[min(len(groups), g + per)]) for g in range(0, len(groups), per)]

    def _forward_tokens(self, s: StepState) -> int:
        """The tokens a pass over the batch puts through the model, every rank's: each
        mini-batch's micro-batches as ``_micro_slices`` cuts them, a group's prefix again in a
        micro-batch that starts inside the group."""
        return sum(packed_tokens(s.lengths, split, s.units) for lo, hi in self._mini_batches(s)
                   for split in self._rank_splits(s.lengths, lo, hi, s.units))

    def _updates(self, s: StepState) -> None:
        """``ppo_epochs`` passes over the mini-batches (whole groups each), one optimizer update
        per mini-batch, its gradient accumulated over this rank's micro-batches."""
        cfg = self.cfg
        bounds = self._mini_batches(s)
        keep = s.batch_corr.keep if s.batch_corr is not None else s.batch.response_mask
        # each mini-batch's kept tokens (its loss's denominator), read from the device at once
        token_counts = [float(c) for c in
                        torch.stack([keep[lo:hi].sum() for lo, hi in bounds]).tolist()]
        s.times.begin("update_actor")  # the critic's share is moved to update_critic below
        for epoch in range(cfg.ppo_epochs):
            for (lo, hi), token_count in zip(bounds, token_counts, strict=True):
                self.policy.optimizer.zero_grad(set_to_none=True)
                micro = self._micro_slices(s.lengths, lo, hi, s.units)
                for sl in micro:
                    self._check_abort()
                    for module in (self.policy.model, self.policy.critic):
                        if self.policy.keep_gathered:
                            sync_gradients(module, last=sl is micro[-1])
                    self._micro_batch(s, sl, epoch, token_count, hi - lo)
                self._check_abort()
                s.grad_norms.append(_full(distributed.clip_grad_norm_(
                    [p for p in self.policy.model.parameters() if p.requires_grad],
                    cfg.max_grad_norm)))
                if self.before_update is not None:
                    self.before_update()
                distributed.optimizer_step(self.policy.optimizer)
                self._updated = True
                self.policy.scheduler.step()
                critic, critic_optimizer = self.policy.critic, self.policy.critic_optimizer
                if critic is not None and critic_optimizer is not None:  # both, or neither
                    with s.times("update_critic"):
                        distributed.clip_grad_norm_(list(critic.parameters()), cfg.max_grad_norm)
                        distributed.optimizer_step(critic_optimizer)
                        critic_optimizer.zero_grad(set_to_none=True)
        s.times.end("update_actor")
        s.times.seconds["update_actor"] -= s.times.seconds.get("update_critic", 0.0)
        self.policy.optimizer.zero_grad(set_to_none=True)

    def _micro_batch(self, s: StepState, sl: slice, epoch: int, token_count: float,
                     seq_count: int) -> None:
        """One micro-batch's forward and backward (policy, then critic); its metrics are summed
        on the device, weighted by its kept tokens."""
        algo, temp = self.algo, s.sampling.temperature
        self.policy.fit_checkpointing(sum(s.lengths[sl]))
        mb = s.batch.rows(sl)
        w = mb.response_mask.shape[1]
        lp, entropy = response_logprobs(self.policy.model, mb, temp, with_entropy=True)
        if s.inline_old:
            old_mb = lp.detach()
            corr = correction(algo, old_mb, mb.behaviour_logprobs, mb.response_mask)
        else:
            old_mb = s.old[sl, :w]
            corr = (correction(algo, old_mb, mb.behaviour_logprobs, mb.response_mask)
                    if s.batch_corr is None else _rows(s.batch_corr, sl, w))
        s.old_seen[sl, :w] = old_mb
        if epoch == 0:
            s.current[sl, :w] = lp.detach()
        loss, m = micro_batch_loss(
            algo, lp, entropy, mb, s.advantages[sl, :w], old_mb, corr,
            s.ref[sl, :w] if s.ref is not None else None, token_count=token_count,
            seq_count=seq_count, norm_constant=algo.loss_scale_factor
            or float(s.sampling.max_tokens))
        loss.backward()
        n_tok = corr.keep.sum().double()  # (on the device: read once per step)
        s.tokens_seen = s.tokens_seen + n_tok
        for k, v in m.items():
            s.sums[k] = s.sums.get(k, 0.0) + v * n_tok
        if self.policy.critic is not None and s.values is not None:  # both, or neither
            with s.times("update_critic"):
                v_new = critic_values(self.policy.critic, mb)
                vloss, vm = critic_loss(algo, v_new, s.values[sl, :w], s.returns[sl, :w],
                                        mb.response_mask, token_count=token_count,
                                        seq_count=seq_count)
                vloss.backward()
            for k, v in vm.items():
                s.critic_sums[k] = s.critic_sums.get(k, 0.0) + v * n_tok

    def _report(self, s: StepState, started: float,
                trace: dict[str, torch.Tensor] | None) -> dict[str, float]:
        """The step's metrics: the losses' token-weighted means over every rank, the
        correction over the whole batch, staleness, timings, throughput and the batch's own."""
        batch, groups, metrics = s.batch, s.groups, s.metrics
        mask = batch.response_mask
        summed = {**s.sums, **s.critic_sums}
        names = list(summed)  # the same on every rank: the same code ran on each
        # the step's one read of its per-micro-batch sums and norms from the device
        n = len(s.grad_norms)  # (one per optimizer update: at least one)
        local = _floats([s.tokens_seen, *(summed[k] for k in names), *s.grad_norms])
        grad_norms = local[-n:]
        tokens_seen, *values_summed = self.group.sum_floats(local[:-n])
        metrics.update({k: v / max(tokens_seen, 1.0) for k, v in zip(names, values_summed, strict=True)})
        self.group.sum_(s.old_seen)  # each row from the rank that trained on it
        self.group.sum_(s.current)
        probe, final, weights = self._final_correction(batch, s.old_seen, s.current)
        metrics.update(final.metrics)
        metrics.update(weight_metrics(probe, batch.behaviour_logprobs, final.keep, weights))
        metrics.update(staleness_histogram(staleness(s.trained_at, batch.versions)))
        metrics.update(token_staleness(s.trained_at, batch, mask))
        metrics["timing_s/weight_sync"] = sum(g.weight_sync_s for g in groups)
        if self.topo.teacher.path:  # the teacher's slowest answer among the batch's groups
            metrics["timing_s/teacher"] = max(g.teacher_seconds for g in groups)
        # the sampler's side: its longest generation call among the batch's groups (a call
        # generates a request's prompts together); in async mode it overlaps the learner's step
        metrics["timing_s/gen"] = max(g.generate_seconds for g in groups)
        metrics.update(s.times.metrics())
        # a vision-language model: its language model's FLOPs and its vision tower's
        patches = [] if batch.vision is None else batch.vision.image_grid_thw.prod(-1).tolist()
        metrics.update(perf_metrics(self.policy.model.config.get_text_config(), self.policy.device,
                                    s.lengths, self.cfg.ppo_epochs,
                                    s.times.seconds["update_actor"], self.group.world,
                                    vision_flops(self.vision_tower, patches)))
        metrics.update(self._batch_metrics(s, grad_norms, time.monotonic() - started))
        if trace is not None:
            trace.update(input_ids=batch.input_ids, mask=mask, keep=final.keep,
                         advantages=s.advantages, behaviour_logprobs=batch.behaviour_logprobs,
                         old_logprobs=s.old_seen, current_logprobs=s.current, is_weights=weights)
        return metrics

    def _batch_metrics(self, s: StepState, grad_norms: list[float],
                       elapsed: float) -> dict[str, float]:
        """The batch's scores, advantages and lengths, the optimizer's, and the step's time."""
        batch, metrics = s.batch, {}
        mask = batch.response_mask
        lengths = mask.sum(1)
        adv_at = s.advantages[mask.bool()]
        metrics.update({
            "critic/score/mean": float(batch.scores.mean()), "critic/score/max": float(batch.scores.max()),
            "critic/score/min": float(batch.scores.min()),
            # (nan for a batch with no token to train: every response cut before the model wrote)
            "critic/advantages/mean": float(adv_at.mean()),
            "critic/advantages/max": float(adv_at.max()) if adv_at.numel() else math.nan,
            "critic/advantages/min": float(adv_at.min()) if adv_at.numel() else math.nan,
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float(batch.truncated.float().mean()),
            "actor/grad_norm": sum(grad_norms) / len(grad_norms),
            "actor/lr": self.policy.scheduler.get_last_lr()[0],
            "timing_s/step": elapsed,
            "perf/throughput": float(batch.attention_mask.sum()) / elapsed,
            # the tokens a shared prefix kept out of the forward passes (learner.share_prefixes),
            # less the prefixes computed again where a micro-batch starts inside their group
            "perf/shared_prefix_tokens": float(sum(read_lengths(list(batch.lengths)))
                                               - self._forward_tokens(s)),
        })
        metrics.update(agent_metrics(s.groups))  # multi-turn batches only
        if s.values is not None:
            metrics["critic/values/mean"] = float(s.values[mask.bool()].mean())
            metrics["critic/returns/mean"] = float(s.returns[mask.bool()].mean())
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
        applied = not bypass or algo.policy_loss.weights_in_loss(algo.correction)
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
