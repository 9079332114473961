"""The learner's models and their training state: what a checkpoint holds and restores.

``Policy`` loads the policy (a full model, or LoRA adapters on a frozen base), the reference
model a KL term needs (the initial weights; with LoRA, the base without adapters), the critic
for GAE, the optimizers and the learning-rate schedule, and the KL controller; it places them on
its device, hands out the published weights (``snapshot``) and writes Hugging Face checkpoints
that ``from_pretrained`` and the samplers load. The training step is ``actors/learner/trainer.py``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoConfig, AutoTokenizer

from actors.data.vision import ImageProcessor, is_vision_model
from actors.learner import distributed
from actors.learner.batch import RolloutBatch
from actors.learner.distributed import Group
from actors.learner.memory import (
    base_config,
    gpu_share,
    gradient_checkpointing,
    needs_without_checkpointing,
    token_activation_bytes,
)
from actors.learner.objective import attach_forward, response_logprobs
from actors.learner.packing import GPU_TOKENS, micro_limits
from actors.learner.vision import freeze_vision_tower, lora_targets
from actors.model_store import PolicyModel
from actors.runtime.config import Topology
from actors.runtime.devices import cap_memory, resolve_device, resolve_dtype
from actors.runtime.ranks import Rank
from actors.runtime.rundir import (
    CHECKSUMS,
    PARTIAL_PREFIX,
    STATE_FILE,
    DiskFull,
    checkpoint_dir,
    checkpoints,
    latest_checkpoint,
    out_of_space,
    prune_checkpoints,
    read_state,
    write_checksums,
)
from kernels import varlen_attention
from kernels.kl_control import AdaptiveKLController, FixedKLController
from messages.weights import AdapterSpec


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
    """The policy, reference and critic models with their optimizers, on one device, or sharded
    over the learner's ranks (``group``: FSDP2, ``actors/learner/distributed.py``).

    ``checkpoint`` says where the state comes from: ``"latest"`` (the run directory's newest
    checkpoint when ``learner.resume`` is set, else the base model), a given ``step_N``
    directory, or ``None`` (the base model with a fresh optimizer: the state before step 1).
    Only ``save_checkpoint`` writes into ``run_dir``. Without ``group``, a lone rank on
    ``learner.device`` (in a process group of its own when its compute dtype needs FSDP's mixed
    precision, or ``learner.offload`` FSDP's CPU offload). With a group, every method below that
    touches the models is a collective.
    """

    def __init__(self, topology: Topology, run_dir: Path,
                 checkpoint: Path | Literal["latest"] | None = "latest",
                 group: Group | None = None) -> None:
        self.topo, self.cfg, self.algo = topology, topology.learner, topology.algorithm
        self.run_dir = run_dir
        torch.manual_seed(topology.run.seed)
        base = Path(topology.model.path)
        self.dtype = getattr(torch, topology.model.dtype)  # parameters and optimizer state
        if group is None:
            group = learner_group(topology)
        self.group = group
        self.device = group.device  # every model and batch tensor of the step lives here
        self.compute_dtype = compute_dtype(topology, self.device)  # forward and backward
        # sharded models keep their gathered parameters until backward (distributed.py)
        self.keep_gathered = distributed.keep_gathered(self.cfg.reshard_after_forward, self.device)
        ckpt, state = self._restore_point(checkpoint)
        self._load_tokenizer(base)
        self._load_model(base, ckpt)
        self._make_optimizer()
        # the reference policy is the initial model; with LoRA it is the base without adapters.
        # It is never trained: held in the compute dtype (bf16 on a GPU), not model.dtype's fp32
        self.ref = None
        if self.keeps_reference:
            self.ref = self._load_reference(base)
        self.critic: torch.nn.Module | None = None  # the value model, with a critic's estimator
        self.critic_optimizer: torch.optim.Optimizer | None = None
        if self.algo.adv_estimator.critic:
            self._load_critic(base, ckpt)
        k = self.algo.kl_ctrl
        self.kl_ctrl = (FixedKLController(k.kl_coef) if k.type == "fixed"
                        else AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon))
        if ckpt is not None:
            self._load_training_state(ckpt, state)
        self.saved_step = self.step
        # the temp folder a checkpoint is written into is named by rank 0's pid on every rank
        self.writer = int(self.group.sum_floats([os.getpid() if self.group.leader else 0])[0])

    # -- models ---------------------------------------------------------------------------------

    def _restore_point(self, checkpoint: Path | Literal["latest"] | None) -> tuple[Path | None, dict]:
        """The checkpoint this policy starts from (``latest``: the run's newest when
        ``learner.resume``) and its saved state; sets ``step`` and ``resumed_from``."""
        self.step = 0
        state: dict = {}
        if checkpoint == "latest":
            ckpt = latest_checkpoint(self.run_dir) if self.cfg.resume else None
        else:
            ckpt = checkpoint
        if ckpt is not None:
            state = read_state(ckpt)
            self.step = state["step"]
        self.resumed_from = ckpt
        return ckpt, state

    def _load_tokenizer(self, base: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.pad_id = self.tokenizer.pad_token_id
        # a vision-language model's processor: the prompts' images to pixel tensors
        self.processor = ImageProcessor(base) if is_vision_model(base) else None
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id

    def _load_model(self, base: Path, ckpt: Path | None) -> None:
        """The trained model, its gradient checkpointing chosen and its vision tower frozen
        when ``model.freeze_vision`` asks."""
        self.model = self._load(lambda: self._load_policy(base, ckpt), base,
                                empty=lambda: self._with_adapter(PolicyModel.from_config(
                                    AutoConfig.from_pretrained(base), dtype=self.dtype)))
        # auto on a GPU: decided again for each micro-batch by what it needs (fit_checkpointing)
        self.auto_checkpointing = (self.cfg.gradient_checkpointing == "auto"
                                   and self.device.type == "cuda")
        self.checkpointing = False
        self._set_checkpointing(gradient_checkpointing(
            self.cfg.gradient_checkpointing, self.device, lambda: self._checkpointing_need(
                micro_limits(self.cfg, cuda=True)[1] or GPU_TOKENS)))
        if self.topo.model.freeze_vision:
            freeze_vision_tower(self.model)
        self.model.train()

    def _make_optimizer(self) -> None:
        """AdamW over the trainable parameters, and its learning-rate schedule over every
        update of the run."""
        updates = self.cfg.total_steps * self.cfg.ppo_epochs * self.cfg.ppo_mini_batches
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=self.cfg.lr, betas=self.cfg.betas,
                                           weight_decay=self.cfg.weight_decay,
                                           fused=fused_adamw(self.device))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(
            self.cfg.lr_scheduler, self.cfg.warmup_steps, updates, self.cfg.min_lr_ratio))

    def _load_reference(self, base: Path):
        ref = self._load(lambda: PolicyModel.from_pretrained(
            base, dtype=self.compute_dtype), base, self.compute_dtype).eval()
        ref.requires_grad_(False)
        return ref

    def _load_critic(self, base: Path, ckpt: Path | None) -> None:
        """The value model (from the checkpoint's ``critic`` folder when it has one) and its
        optimizer."""
        from actors.learner.critic import ValueModel
        source = ckpt / "critic" if ckpt is not None and (ckpt / "critic").is_dir() else base
        self.critic = distributed.load(
            self.group, lambda: ValueModel(source, self.dtype),
            lambda: ValueModel(source, self.dtype, weights=False),
            compute=self.compute_dtype, params=self.dtype, keep=self.keep_gathered,
            offload=self.cfg.offload)
        if self.cfg.packing:
            varlen_attention.choose(self.critic.body, self.device)
        self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=self.cfg.critic_lr,
                                                  betas=self.cfg.betas,
                                                  fused=fused_adamw(self.device))


    def fit_checkpointing(self, tokens: int) -> None:
        """``learner.gradient_checkpointing = auto`` on a GPU: recompute activations in the
        backward of a micro-batch of ``tokens`` tokens only when, without, it would need more
        than ``CHECKPOINT_ABOVE`` of this process's GPU memory (``gradient_checkpointing``)."""
        if self.auto_checkpointing:
            self._set_checkpointing(gradient_checkpointing(
                "auto", self.device, lambda: self._checkpointing_need(tokens), self._usable))

    def _set_checkpointing(self, on: bool) -> None:
        if on == self.checkpointing:
            return
        if on:
            self.model.gradient_checkpointing_enable()
            self.model.config.use_cache = False
        else:
            self.model.gradient_checkpointing_disable()
        self.checkpointing = on

    @functools.cached_property
    def _usable(self) -> float:
        return gpu_share(self.device)

    @functools.cached_property
    def _checkpointing_need(self) -> Callable[[int], float]:
        return needs_without_checkpointing(self)

    @functools.cached_property
    def attends_trees(self) -> bool:
        """Whether every model of the step attends with ``flowrl_varlen``, which alone reads a
        packed row whose groups share prefixes (``learner.share_prefixes``)."""
        models = [self.model, self.ref, self.critic.body if self.critic is not None else None]
        return all(m is None or getattr(m.config, "_attn_implementation", None)
                   == varlen_attention.NAME for m in models)

    @functools.cached_property
    def token_activation_bytes(self) -> int:
        """What one token of a micro-batch saves for backward (the auto micro-batch's measure)."""
        return token_activation_bytes(base_config(self.model),
                                      torch.finfo(self.compute_dtype).bits // 8)

    @property
    def keeps_reference(self) -> bool:
        """A frozen reference model is held: a KL term of full fine-tuning (with LoRA the
        reference is the base without its adapters, no second model)."""
        return (self.algo.use_kl_loss or self.algo.use_kl_in_reward) and self.cfg.lora.rank == 0

    def _load(self, full, source: Path, dtype: torch.dtype | None = None, empty=None):
        """A causal LM on this policy's device or shards (``distributed.load``), its parameters
        in ``dtype`` (default model.dtype), with ``response_logprobs`` as one of its forward
        methods when sharded. ``empty``: the architecture without weights (default: the
        causal LM of ``source``'s config)."""
        params = dtype or self.dtype

        def from_config():
            config = AutoConfig.from_pretrained(source)
            return PolicyModel.from_config(config, dtype=params)

        model = distributed.load(self.group, full, empty or from_config, compute=self.compute_dtype,
                                 params=params, keep=self.keep_gathered,
                                 offload=self.cfg.offload)
        if self.cfg.packing:  # attention over packed rows without a (T, T) mask
            varlen_attention.choose(model.get_base_model() if hasattr(model, "get_base_model")
                                    else model, self.device)
        if distributed.is_sharded(model):
            attach_forward(model)
        return model

    def _load_policy(self, base: Path, ckpt: Path | None):
        if self.cfg.lora.rank == 0:
            return PolicyModel.from_pretrained(ckpt or base, dtype=self.dtype)
        from peft import PeftModel
        model = PolicyModel.from_pretrained(base, dtype=self.dtype)
        if ckpt is not None:  # the adapter at the top (older checkpoints: in adapter/)
            folder = ckpt / "adapter" if (ckpt / "adapter").is_dir() else ckpt
            return PeftModel.from_pretrained(model, folder, is_trainable=True)
        return self._with_adapter(model)

    def _with_adapter(self, model):
        """``model`` with fresh LoRA adapters (``learner.lora``) on its frozen weights, or
        ``model`` itself for full fine-tuning."""
        lora = self.cfg.lora
        if lora.rank == 0:
            return model
        from peft import LoraConfig, get_peft_model
        return get_peft_model(model, LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=lora_targets(model, lora.target_modules, lora.vision)))

    def _load_training_state(self, ckpt: Path, state: dict) -> None:
        self._load_optimizer(ckpt, "optimizer", self.model, self.optimizer)
        self.scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt"))
        self._configured_lr()
        if self.critic_optimizer is not None:
            self._load_optimizer(ckpt, "critic_optimizer", self.critic, self.critic_optimizer)
            for group in self.critic_optimizer.param_groups:
                group["lr"] = self.cfg.critic_lr
        self.kl_ctrl.value = state.get("kl_coef", self.kl_ctrl.value)

    def _configured_lr(self) -> None:
        """The topology's learning rate over the checkpoint's (its optimizer and schedule hold
        the one they were made with): a resume with ``learner.lr`` changed trains on with the
        new rate, at the schedule's place the checkpoint holds. Unchanged, the rate is the same
        product as the schedule's own step computes."""
        sched = self.scheduler
        sched.base_lrs = [self.cfg.lr for _ in self.optimizer.param_groups]
        for group, at in zip(self.optimizer.param_groups, sched.lr_lambdas, strict=True):
            group["initial_lr"] = self.cfg.lr
            group["lr"] = self.cfg.lr * at(sched.last_epoch)
        sched._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _load_optimizer(self, ckpt: Path, name: str, model, optimizer) -> None:
        """The sharded state (``NAME/``, any number of ranks), or the one-file state of
        checkpoints written before the learner had ranks (``NAME.pt``, one rank only)."""
        if (ckpt / name).is_dir():
            distributed.load_optimizer(ckpt / name, model, optimizer, self.group)
        elif (ckpt / f"{name}.pt").is_file():
            if self.group.distributed:
                raise ValueError(f"{ckpt / name}.pt was written by a one-rank learner of an "
                                 "older version: resume it with learner.nproc_per_node = 1")
            optimizer.load_state_dict(torch.load(ckpt / f"{name}.pt"))

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

    def snapshot(self, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                 live: bool = False) -> list[tuple[str, torch.Tensor]]:
        """A copy of every policy parameter (tied ones once) on ``device`` (the CPU for the
        shm and zmq transports, the learner's own device for the GPU ones), LoRA merged, in the
        base names, in ``dtype`` (default: as trained). Sharded, it is a collective: the shards
        are cast to ``dtype`` and gathered layer by layer on the learner's device (one layer
        whole beyond its shards at a time) and only rank 0 gets the list (the others an
        empty one). ``live``: the caller is done reading the tensors before the parameters
        change next (the shm transport writes them out at once), so on one rank a parameter
        already on ``device`` in ``dtype`` is given as is, not copied."""
        if self.cfg.lora.rank == 0:
            copy = not live or self.group.world > 1  # gathered shards: buffers reused per layer
            return [(name, value.to(device, copy=copy))
                    for name, value in distributed.full_parameters(self.model, self.group, dtype)
                    if value is not None]
        from peft.tuners.lora import LoraLayer
        merged = {}
        core = self.model.get_base_model()
        with torch.no_grad():
            for name, module in core.named_modules():
                if isinstance(module, LoraLayer):
                    # every concrete LoRA layer defines it; PEFT's LoraLayer base declares none
                    delta = module.get_delta_weight(  # type: ignore[attr-defined]
                        module.active_adapters[0])
                    merged[f"{name}.weight"] = module.get_base_layer().weight + delta
            out = []
            for name, p in core.named_parameters():
                if "lora_" in name:
                    continue
                clean = name.replace(".base_layer", "")
                value = merged.get(clean, p).detach()
                out.append((clean, value.to(device, dtype or value.dtype, copy=True)))
        return out

    def adapter_spec(self) -> AdapterSpec | None:
        """What the samplers need to apply this policy's LoRA adapters (None: full weights)."""
        lora = self.cfg.lora
        if lora.rank == 0:
            return None
        targets = self.model.peft_config["default"].target_modules  # what the adapters are on
        return AdapterSpec(rank=lora.rank, alpha=lora.alpha,
                           target_modules=sorted(targets) if isinstance(targets, set)
                           else list(targets))

    def adapter_snapshot(self, dtype: torch.dtype | None = None,
                         device: torch.device | str = "cpu") -> list[tuple[str, torch.Tensor]]:
        """A copy of the LoRA adapters only (what a LoRA version publishes: the base never
        changes), under the names PEFT saves them with (``...q_proj.lora_A.weight``, what
        ``PeftModel.from_pretrained`` and vLLM's LoRA loading read), in ``dtype`` (default: as
        trained), on ``device``. Sharded, it is a collective (each adapter gathered whole in
        turn: they are megabytes) and only rank 0 gets the list (the others an empty one)."""
        from torch.distributed.tensor import DTensor

        out = []
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_" not in name:
                    continue
                value = p.full_tensor() if isinstance(p, DTensor) else p
                if self.group.leader:  # PEFT's saved name: without the adapter's own
                    out.append((name.replace(".default.", "."),
                                value.detach().to(device, dtype or value.dtype, copy=True)))
        return out

    def published(self, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                  live: bool = False) -> list[tuple[str, torch.Tensor]]:
        """What a publish sends: the LoRA adapters alone (the samplers hold the base), or every
        weight (``live``: as ``snapshot``'s). A collective when sharded (only rank 0 gets the
        list)."""
        if self.cfg.lora.rank:
            return self.adapter_snapshot(dtype, device)
        return self.snapshot(dtype, device, live=live)

    def save_checkpoint(self) -> Path:
        """Write an HF-format checkpoint atomically (temp dir, then rename); then remove the ones
        older than the ``keep_checkpoints`` newest (the final one is always kept).

        The weights are gathered whole to rank 0, which writes them as ``from_pretrained`` (and
        vLLM) load them (LoRA: the adapter alone, in PEFT's format); the optimizer state is written sharded by every rank
        (``optimizer/``, torch.distributed.checkpoint), and loads with any number of ranks. A
        collective when sharded (the folder must be on a filesystem every rank sees)."""
        final = checkpoint_dir(self.run_dir, self.step)
        tmp = final.parent / f"{PARTIAL_PREFIX}{self.step}_{self.writer}"
        lead = self.group.leader
        # (the others wait for the first rank at the write's first barrier)
        while lead and len(checkpoints(self.run_dir)) > 1 and \
                shutil.disk_usage(self.run_dir).free < self._checkpoint_bytes():
            self._make_room(final, ahead=True)
        while True:
            try:
                self._write_checkpoint(tmp, lead)
                break
            except Exception as exc:
                if not out_of_space(exc, final.parent):
                    raise
                if lead:
                    shutil.rmtree(tmp, ignore_errors=True)
                if not self._make_room(final):
                    raise DiskFull(final.parent, f"checkpoint {final.name}",
                                   self._checkpoint_bytes()) from exc
        if lead:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            prune_checkpoints(self.run_dir, self.cfg.keep_checkpoints, self.cfg.total_steps)
        self.group.barrier()  # no rank goes on before the checkpoint exists
        self.saved_step = self.step
        return final

    def _write_checkpoint(self, tmp: Path, lead: bool) -> None:
        """Every file of the checkpoint into ``tmp``, its checksums last."""
        if lead:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self.group.barrier()
        if self.cfg.lora.rank == 0:
            _save_pretrained(self.model, tmp, distributed.full_state_dict(self.model, self.group),
                             lead)
        else:  # the PEFT adapter alone (megabytes): PeftModel.from_pretrained(base, it) and
            # vLLM's LoRARequest load it; `runner.py export --merge` writes a merged model
            adapters = self.adapter_snapshot()  # (a collective when sharded)
            if lead:
                from safetensors.torch import save_file

                self.model.peft_config["default"].save_pretrained(tmp)
                save_file(dict(adapters), str(tmp / "adapter_model.safetensors"),
                          metadata={"format": "pt"})
        distributed.save_optimizer(tmp / "optimizer", self.model, self.optimizer, self.group)
        if self.critic is not None:
            state = distributed.full_state_dict(self.critic, self.group)
            if lead:
                (tmp / "critic").mkdir()
                self.critic.save(tmp / "critic", state)
            distributed.save_optimizer(tmp / "critic_optimizer", self.critic,
                                       self.critic_optimizer, self.group)
        if lead:
            self.tokenizer.save_pretrained(tmp)
            torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
            (tmp / STATE_FILE).write_text(json.dumps({
                "step": self.step, "version": self.version, "kl_coef": self.kl_ctrl.value,
                "ranks": self.group.world, "checksums": CHECKSUMS}))
        self.group.barrier()  # every rank's shards are in tmp
        if lead:
            write_checksums(tmp)  # (every rank's files: the folder is on a shared filesystem)

    def _make_room(self, final: Path, ahead: bool = False) -> bool:
        """Remove the oldest checkpoint but the newest (the one a resume would take), saying
        so; False when there is none such. ``ahead``: on the leader before the checkpoint is
        written, where the disk has less room than the newest checkpoint takes, so several
        ranks prune as one does. Not ``ahead`` (a write that ran out of space), on one rank
        only: several would have to agree mid-write; they stop instead."""
        found = checkpoints(self.run_dir)
        if (self.group.world > 1 and not ahead) or len(found) < 2:
            return False
        shutil.rmtree(found[0][1], ignore_errors=True)
        print(f"[learner] no space left in {final.parent} for {final.name}: removed "
              f"{found[0][1].name} to make room (fewer than learner.keep_checkpoints = "
              f"{self.cfg.keep_checkpoints} are kept)", file=sys.stderr, flush=True)
        return True

    def _checkpoint_bytes(self) -> int:
        """About what a checkpoint takes: the newest one's files, or the weights and two
        float32 optimizer moments per parameter."""
        newest = latest_checkpoint(self.run_dir)
        if newest is not None:
            return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
        return sum(p.numel() * (p.element_size() + 8) for p in self.model.parameters())


def _save_pretrained(model, path: Path, state: dict[str, torch.Tensor], lead: bool) -> None:
    """``save_pretrained`` of a (maybe sharded) model from its whole ``state`` (on rank 0)."""
    if not lead:
        return
    model.save_pretrained(path, state_dict=state)
    if distributed.is_sharded(model):  # FSDP's class is FSDP<Model>: name the model's own
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = [distributed.unwrapped_class(model).__name__]
        (path / "config.json").write_text(json.dumps(config, indent=2))


def learner_group(topology: Topology, rank: Rank | None = None) -> Group:
    """This process's place among the learner's ranks (default: a learner of its own): joined
    to the group when there are several ranks, or when one needs FSDP's mixed precision or CPU
    offload (a process group of one); otherwise a lone rank with no process group."""
    rank = rank or Rank.from_env({})
    device = resolve_device(topology.learner.device, rank.local_rank)
    cap_memory(device)
    mixed = compute_dtype(topology, device) != getattr(torch, topology.model.dtype)
    if rank.world_size == 1 and not mixed and not topology.learner.offload:
        return Group.lone(device)
    return Group.join(rank, device, timeout_s=topology.learner.collective_timeout_s,
                      offload=topology.learner.offload)


def fused_adamw(device: torch.device) -> bool:
    """AdamW's fused kernel: one call per step for every parameter (DTensor ones of FSDP2
    included) instead of a dozen ops per parameter (torch's default on a CPU) or a dozen
    foreach ops (on a GPU), each with its own dispatch; on a CPU it is also the fastest (one
    pass over each parameter's memory: BENCHMARKS.md, the learner)."""
    return device.type in ("cuda", "cpu")


def compute_dtype(topology: Topology, device: torch.device) -> torch.dtype:
    """``learner.dtype`` on ``device``; LoRA computes in model.dtype (no master copies)."""
    if topology.learner.lora.rank > 0:
        return getattr(torch, topology.model.dtype)
    return resolve_dtype(topology.learner.dtype, device, topology.model.dtype)
