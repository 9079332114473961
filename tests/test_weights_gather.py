"""The learner's weights gather over FSDP2 shards (two gloo CPU ranks): layer by layer, each
rank's shards cast to the sampler's dtype before the all-gather; rank 0 must get exactly the
unsharded model's parameters in that dtype (a cast commutes with the gather, so equality is
exact), uneven shards (rows not divisible by the ranks) included."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from actors.learner.distributed import _layers
from actors.runtime.ranks import free_port, node_ranks
from tests.jobs import ROOT
from tests.tiny_model import build_tiny_model


def test_parameters_are_grouped_by_layer():
    names = ["model.embed_tokens.weight", "model.layers.0.a.weight", "model.layers.0.b.weight",
             "model.layers.1.a.weight", "model.layers.10.a.weight", "model.norm.weight",
             "lm_head.weight"]
    groups = [[n for n, _ in g] for g in _layers(iter((n, None) for n in names))]  # type: ignore[arg-type]
    assert groups == [names[:1], names[1:3], names[3:4], names[4:5], names[5:6], names[6:]]


def test_two_ranks_gather_the_unsharded_weights_in_the_samplers_dtype(tmp_path):
    model = build_tiny_model(tmp_path / "model", hidden=48, words=("seven",))  # 45 rows
    out = tmp_path / "out"
    out.mkdir()
    procs = []
    for r in node_ranks(2, 1, 0, "127.0.0.1", free_port()):
        env = {**os.environ, **r.env(), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.gather_worker", str(model),
                                       str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    logs = [p.communicate(timeout=500)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    whole = dict(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
                 .named_parameters())
    assert any(t.shape[0] % 2 for t in whole.values())  # an uneven shard is among them
    for dtype in (torch.bfloat16, torch.float32):
        got = load_file(str(out / f"{str(dtype).removeprefix('torch.')}.safetensors"))
        assert sorted(got) == sorted(whole)  # every parameter, tied ones once
        for name, t in whole.items():
            assert got[name].dtype == dtype
            assert torch.equal(got[name], t.detach().to(dtype)), name
