"""The learner's compute, synchronous torch code run in a worker thread by the actor.

One step on a batch of scored groups: GRPO advantages per group, then, micro-batch by
micro-batch with gradient accumulation, the PPO-clip loss with off-policy correction:

- ``decoupled`` (AReaL): the proximal log-probs ``lp_old`` are the current weights' log-probs
  at the start of the step; the PPO ratio is ``π_θ/π_old`` and each token's loss is weighted by
  the truncated behaviour weight ``min(π_old/μ, tis_cap)`` (detached).
- ``bypass``: the sampler's behaviour log-probs serve as ``lp_old``; PPO clip does the correction.

With one PPO epoch over one mini-batch the weights do not change before every micro-batch's
forward has run, so ``lp_old`` equals the forward's own (detached) log-probs: the recompute
is that same forward, not a second one.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.runtime.config import Topology
from actors.runtime.tensors import from_wire
from kernels.advantages import grpo_advantages
from kernels.importance import mismatch_metrics, truncated_is_weights
from kernels.logprobs import entropy_from_logits, token_logprobs
from kernels.losses import ppo_clip_loss
from messages.rollout import ScoredGroup

STATE_FILE = "trainer_state.json"


class Aborted(Exception):
    """The step was abandoned because the actor is stopping (no optimizer step was taken)."""


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (written atomically, so any ``step_*`` dir is whole)."""
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
    return ckpts[-1] if ckpts else None


class Trainer:
    def __init__(self, topology: Topology, run_dir: Path) -> None:
        self.topo = topology
        self.cfg = topology.learner
        self.algo = topology.algorithm
        self.run_dir = run_dir
        self.abort = threading.Event()
        torch.manual_seed(topology.run.seed)
        source = Path(topology.model.path)
        self.step = 0
        resume_from = latest_checkpoint(run_dir) if self.cfg.resume else None
        if resume_from is not None:
            source = resume_from
            self.step = json.loads((resume_from / STATE_FILE).read_text())["step"]
        self.resumed_from = resume_from
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        dtype = getattr(torch, topology.model.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr,
                                           betas=self.cfg.betas, weight_decay=self.cfg.weight_decay)
        if resume_from is not None and (resume_from / "optimizer.pt").is_file():
            self.optimizer.load_state_dict(torch.load(resume_from / "optimizer.pt"))
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        self.saved_step = self.step

    @property
    def version(self) -> int:
        """Policy version = optimizer steps taken since the start of the run."""
        return self.step

    # -- one training step -------------------------------------------------------------------

    def _sequences(self, groups: list[ScoredGroup]):
        seqs = []  # (prompt ids, response ids, behaviour logprobs, reward, version, finish)
        for g in groups:
            prompt = from_wire(g.prompt_ids).long()
            for s in g.samples:
                seqs.append((prompt, from_wire(s.response_ids).long(),
                             from_wire(s.behaviour_logprobs).float(), s.reward, s.policy_version,
                             s.finish_reason))
        return seqs

    def _micro_batch(self, seqs):
        """Right-padded inputs with targets and masks aligned to next-token positions."""
        width = max(len(p) + len(r) for p, r, *_ in seqs)
        B = len(seqs)
        ids = torch.full((B, width), self.pad_id, dtype=torch.long)  # (B, W)
        attn = torch.zeros((B, width), dtype=torch.long)
        mask = torch.zeros((B, width - 1))  # (B, W-1): 1 where the target is a response token
        behav = torch.zeros((B, width - 1))
        for i, (p, r, lp, *_ ) in enumerate(seqs):
            n = len(p) + len(r)
            ids[i, :n] = torch.cat([p, r])
            attn[i, :n] = 1
            mask[i, len(p) - 1 : n - 1] = 1
            behav[i, len(p) - 1 : n - 1] = lp
        return ids, attn, mask, behav

    def _response_logprobs(self, ids, attn, mask):
        """Log-probs of the response tokens, with the LM head applied only where they are.

        The prompt is most of each sequence here, and the LM head (V = 49,152 columns) is a large
        share of the compute, so hidden states are gathered at response positions first.
        Returns ``lp`` (B, W-1) with zeros outside ``mask`` and the (N, V) response logits.
        """
        hidden = self.model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
        at = mask.bool()  # (B, W-1)
        logits = self.model.get_output_embeddings()(hidden[:, :-1][at])  # (N, V)
        lp_at = token_logprobs(logits, ids[:, 1:][at], self.topo.sampler.temperature,
                               chunk_size=1024)  # (N,)
        lp = torch.zeros(mask.shape, dtype=lp_at.dtype).masked_scatter(at, lp_at)  # (B, W-1)
        return lp, logits

    def train_step(self, groups: list[ScoredGroup]) -> dict[str, float]:
        started = time.monotonic()
        algo, cfg = self.algo, self.cfg
        seqs = self._sequences(groups)
        n = len(groups[0].samples)
        if any(len(g.samples) != n for g in groups):
            raise ValueError("every group of a batch must have the same number of samples")
        rewards = torch.tensor([s[3] for s in seqs], dtype=torch.float32)
        adv = grpo_advantages(rewards, n, norm_by_std=algo.adv_estimator == "grpo")  # (N,)
        total_tokens = sum(len(s[1]) for s in seqs)
        sums: dict[str, float] = {}
        old_all, behav_all, mask_all = [], [], []
        self.optimizer.zero_grad(set_to_none=True)
        for lo in range(0, len(seqs), cfg.micro_batch_size):
            if self.abort.is_set():
                self.optimizer.zero_grad(set_to_none=True)
                raise Aborted
            chunk = seqs[lo : lo + cfg.micro_batch_size]
            ids, attn, mask, behav = self._micro_batch(chunk)
            lp, logits = self._response_logprobs(ids, attn, mask)
            a = adv[lo : lo + len(chunk), None].expand_as(lp)  # (B, W-1)
            if algo.correction == "bypass":
                old, weights = behav, None
            else:
                old = lp.detach()
                weights, _ = truncated_is_weights(old, behav, mask, cap=algo.tis_cap)
            loss, m = ppo_clip_loss(lp, old, a, mask, clip_low=algo.clip_ratio_low,
                                    clip_high=algo.clip_ratio_high, weights=weights,
                                    loss_agg_mode=algo.loss_agg_mode, token_count=total_tokens,
                                    seq_count=len(seqs))
            loss.backward()
            with torch.no_grad():
                ent = entropy_from_logits(logits.detach(), self.topo.sampler.temperature,
                                          chunk_size=1024)  # (N,) at response tokens
            tokens = float(mask.sum())
            for k, v in m.items():  # token-weighted sums, divided by the total below
                sums[k] = sums.get(k, 0.0) + float(v) * tokens
            sums["actor/entropy"] = sums.get("actor/entropy", 0.0) + float(ent.sum())
            old_all.append(old.detach().flatten()[mask.flatten() > 0])
            behav_all.append(behav.flatten()[mask.flatten() > 0])
            mask_all.append(mask.sum(1))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        if self.abort.is_set():
            self.optimizer.zero_grad(set_to_none=True)
            raise Aborted
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

        metrics = {k: v / max(total_tokens, 1) for k, v in sums.items()}
        old_t, behav_t = torch.cat(old_all)[None], torch.cat(behav_all)[None]
        ones = torch.ones_like(old_t)
        w, w_m = truncated_is_weights(old_t, behav_t, ones, cap=algo.tis_cap)
        metrics.update(w_m)
        metrics.update(mismatch_metrics(old_t, behav_t, ones, w))
        lengths = torch.tensor([len(s[1]) for s in seqs], dtype=torch.float32)
        stale = torch.tensor([self.version - 1 - s[4] for s in seqs], dtype=torch.float32)
        elapsed = time.monotonic() - started
        metrics.update({
            "critic/score/mean": float(rewards.mean()), "critic/score/max": float(rewards.max()),
            "critic/score/min": float(rewards.min()),
            "critic/advantages/mean": float(adv.mean()), "critic/advantages/max": float(adv.max()),
            "critic/advantages/min": float(adv.min()),
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": sum(s[5] == "length" for s in seqs) / len(seqs),
            "actor/grad_norm": float(grad_norm), "actor/lr": self.optimizer.param_groups[0]["lr"],
            "staleness/mean": float(stale.mean()), "staleness/max": float(stale.max()),
            "timing_s/step": elapsed,
            "perf/throughput": sum(len(p) + len(r) for p, r, *_ in seqs) / elapsed,
        })
        return metrics

    # -- weights and checkpoints ---------------------------------------------------------------

    def snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """A copy of every parameter (tied ones once), safe to send while training goes on."""
        return [(name, p.detach().clone()) for name, p in self.model.named_parameters()]

    def save_checkpoint(self) -> Path:
        """Write an HF-format checkpoint atomically (temp dir, then rename); prune old ones."""
        root = self.run_dir / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step_{self.step}"
        tmp = root / f".tmp_step_{self.step}_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / STATE_FILE).write_text(json.dumps({"step": self.step, "version": self.version}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.saved_step = self.step
        ckpts = sorted(root.glob("step_*"), key=lambda p: int(p.name[5:]))
        for old in ckpts[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final
