"""One rank of a sharded tiny model in a test: ``python -m tests.gather_worker MODEL OUT`` with
the torchrun variables set by the test. Every rank shards the model (FSDP2 over gloo) and takes
part in ``Policy``'s weights gather (``distributed.full_parameters``) in bfloat16 and float32;
rank 0 writes what it got (``OUT/bfloat16.safetensors``, ``OUT/float32.safetensors``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from actors.learner import distributed
from actors.learner.distributed import Group
from actors.runtime.ranks import Rank


def main(model: Path, out: Path) -> None:
    torch.set_num_threads(1)
    group = Group.join(Rank.from_env(), torch.device("cpu"), timeout_s=120)
    try:
        sharded = distributed.load(
            group, lambda: AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
            lambda: AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)),
            compute=torch.float32, params=torch.float32)
        for dtype in (torch.bfloat16, torch.float32):
            got = {name: t.clone() for name, t in distributed.full_parameters(sharded, group, dtype)
                   if t is not None}
            if group.leader:
                save_file(got, str(out / f"{str(dtype).removeprefix('torch.')}.safetensors"))
    finally:
        group.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
