"""One rank of a learner group in a test: ``python -m tests.ranks_worker MODEL GROUPS OUT CASE...``
with the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set by the test.

Every rank joins the group once, then for each case builds a ``Trainer`` on the tiny model with
that case's overrides and takes one step on the recorded groups (``GROUPS``: a msgpack list of
``ScoredGroup``). Rank 0 writes the step's metrics (``OUT/CASE.json``) and the whole gradient
the optimizer stepped with (``OUT/CASE.safetensors``; gathering it is a collective, so every
rank takes part).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import torch
from safetensors.torch import save_file

from actors.job.config.load import apply_overrides, decode_topology
from actors.learner.policy import learner_group
from actors.learner.trainer import Trainer
from actors.runtime.ranks import Rank
from messages.rollout import ScoredGroup
from tests.rank_cases import BASE, BF16, CASES, GPU_STYLE, LORA


def capture_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The whole gradient of every parameter when the optimizer steps (rank 0; {} elsewhere)."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.policy.optimizer.step

    def recording_step(*args, **kwargs):
        for name, p in trainer.policy.model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                if trainer.group.leader:
                    grads[name] = g.detach().clone()
        return step(*args, **kwargs)

    trainer.policy.optimizer.step = recording_step
    trainer.policy.optimizer.step._wrapped_by_lr_sched = True  # the scheduler's marker
    return grads


def main(model: str, groups_file: str, out: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    groups = msgspec.msgpack.decode(Path(groups_file).read_bytes(), type=list[ScoredGroup])
    every = {**CASES, **GPU_STYLE, **BF16, **LORA}
    first = decode_topology(apply_overrides({}, [f"model.path={model}", *BASE, *every[cases[0]]]))
    group = learner_group(first, Rank.from_env())
    try:
        for case in cases:
            topo = decode_topology(apply_overrides({}, [f"model.path={model}", *BASE, *every[case]]))
            run_dir = Path(out) / f"run-{case}"
            trainer = Trainer(topo, run_dir, "latest" if topo.learner.resume else None, group)
            grads = capture_gradients(trainer)
            metrics = trainer.train_step(groups)
            if group.leader:
                (Path(out) / f"{case}.json").write_text(json.dumps(metrics))
                save_file({k: v.float().contiguous() for k, v in grads.items()},
                          str(Path(out) / f"{case}.safetensors"))
            if case in LORA:  # its checkpoint (a collective): the adapter and sharded optimizer
                trainer.policy.save_checkpoint()
    finally:
        group.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
