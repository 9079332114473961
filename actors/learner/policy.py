"""The learner's models and their training state: what a checkpoint holds and restores.

``Policy`` loads the policy (a full model, or LoRA adapters on a frozen base), the reference
model a KL term needs (the initial weights; with LoRA, the base without adapters), the critic
for GAE, the optimizers and the learning-rate schedule, and the KL controller; it places them on
its device, hands out the published weights (``snapshot``) and writes Hugging Face checkpoints
that ``from_pretrained`` and the samplers load. The training step is ``actors/learner/trainer.py``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from actors.learner.batch import RolloutBatch
from actors.learner.objective import response_logprobs
from actors.runtime.config import Topology
from actors.runtime.rundir import (
    PARTIAL_PREFIX,
    STATE_FILE,
    checkpoint_dir,
    latest_checkpoint,
    prune_checkpoints,
    read_state,
)
from kernels.kl import AdaptiveKLController, FixedKLController


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


class Policy:
    """The policy, reference and critic models with their optimizers, on one device.

    ``checkpoint`` says where the state comes from: ``"latest"`` (the run directory's newest
    checkpoint when ``learner.resume`` is set, else the base model), a given ``step_N``
    directory, or ``None`` (the base model with a fresh optimizer: the state before step 1).
    Only ``save_checkpoint`` writes into ``run_dir``.
    """

    def __init__(self, topology: Topology, run_dir: Path,
                 checkpoint: Path | Literal["latest"] | None = "latest") -> None:
        self.topo, self.cfg, self.algo = topology, topology.learner, topology.algorithm
        self.run_dir = run_dir
        torch.manual_seed(topology.run.seed)
        base = Path(topology.model.path)
        self.dtype = getattr(torch, topology.model.dtype)
        self.device = torch.device("cpu")  # every model and batch tensor of the step lives here
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
        self.model = self._load_policy(base, ckpt).to(self.device)
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
            self.ref = AutoModelForCausalLM.from_pretrained(base, dtype=self.dtype).to(
                self.device).eval()
            self.ref.requires_grad_(False)
        self.critic = self.critic_optimizer = None
        if self.algo.adv_estimator == "gae":
            from actors.learner.critic import ValueModel
            source = ckpt / "critic" if ckpt is not None and (ckpt / "critic").is_dir() else base
            self.critic = ValueModel(source, self.dtype).to(self.device)
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
        """The policy version of the weights now: the steps taken (``actors/runtime/versions.py``)."""
        return self.step

    @torch.no_grad()
    def reference_logprobs(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        if self.ref is not None:
            return response_logprobs(self.ref, batch, temperature)
        with self.model.disable_adapter():  # LoRA: the frozen base is the reference
            return response_logprobs(self.model, batch, temperature)

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
        """Write an HF-format checkpoint atomically (temp dir, then rename); then remove the ones
        older than the ``keep_checkpoints`` newest (the final one is always kept)."""
        final = checkpoint_dir(self.run_dir, self.step)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f"{PARTIAL_PREFIX}{self.step}_{os.getpid()}"
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
        prune_checkpoints(self.run_dir, self.cfg.keep_checkpoints, self.cfg.total_steps)
        return final
