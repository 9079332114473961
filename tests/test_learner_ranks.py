"""The learner as a group of ranks (FSDP2 over gloo, two CPU processes) against one rank.

A step on the same batch gives the same metrics and the same gradient on two ranks as on one,
for every loss aggregation mode and every option that reaches across the batch (batch-wide
passes, normalised weights, rejection, epochs and mini-batches, the critic): the ranks differ
from one rank only in the order floating-point sums are taken (each rank sums its micro-batches,
then the ranks' sums are added). Measured: metrics within 5.3e-7 relative (the smallest IS
weight), gradients within 1.6e-7 of their largest entry; the tolerances below are about 10x.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from actors.runtime.ranks import free_port, node_ranks
from tests.jobs import ROOT
from tests.rank_cases import BASE, BF16, CASES, GPU_STYLE
from tests.test_learner import captured_gradients, make_groups
from tests.tiny_model import build_tiny_model

METRIC_RTOL = 5e-6
GRAD_RTOL = 2e-6  # of the largest gradient entry
LIVE = ("timing_s/", "perf/")  # about the run, not the computation


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def one_rank_trainer(model: Path, run_dir: Path, case: list[str]):
    from actors.job.config.load import apply_overrides, decode_topology
    from actors.learner.trainer import Trainer

    topo = decode_topology(apply_overrides({}, [f"model.path={model}", *BASE, *case]))
    return Trainer(topo, run_dir, None)


def run_ranks(model: Path, groups_file: Path, out: Path, cases: list[str], world: int = 2,
              timeout: float = 900) -> None:
    """The cases on a group of ``world`` CPU ranks (``tests/ranks_worker.py``)."""
    procs = []
    for r in node_ranks(world, 1, 0, "127.0.0.1", free_port()):
        env = {**os.environ, **r.env(), "OMP_NUM_THREADS": "1"}
        log = (out / f"rank{r.rank}.log").open("w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.ranks_worker", str(model), str(groups_file), str(out),
             *cases], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, (out / f"rank{r}.log").read_text()[-4000:]


@pytest.fixture(scope="module")
def two_ranks(tiny, tmp_path_factory):
    """Every case's metrics and gradient on one rank (in this process) and on two."""
    out = tmp_path_factory.mktemp("ranks")
    first = one_rank_trainer(tiny, out / "groups-run", CASES["token-mean"])
    groups = make_groups(first, behaviour_offset=-0.3, n_groups=4)
    groups_file = out / "groups.msgpack"
    groups_file.write_bytes(msgspec.msgpack.encode(groups))
    run_ranks(tiny, groups_file, out, [*CASES, *GPU_STYLE, *BF16])
    one = {}
    for case, opts in CASES.items():
        t = one_rank_trainer(tiny, out / f"one-{case}", opts)
        grads = captured_gradients(t)
        one[case] = (t.train_step(groups), grads)
    return one, out


def read_case(out: Path, case: str) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    return json.loads((out / f"{case}.json").read_text()), load_file(out / f"{case}.safetensors")


@pytest.mark.parametrize("case", [*CASES, *GPU_STYLE])
def test_two_ranks_take_the_step_of_one(two_ranks, case):
    """``-resharded``: FSDP2 as on a GPU (free after forward, reduce every micro-batch)."""
    one, out = two_ranks
    want, want_grads = one[case.removesuffix("-resharded")]
    got, got_grads = read_case(out, case)
    compared = [k for k in want if not k.startswith(LIVE)]
    assert sorted(compared) == sorted(k for k in got if not k.startswith(LIVE))
    diff = {k: abs(want[k] - got[k]) / max(1.0, abs(want[k])) for k in compared}
    off = {k: (want[k], got[k]) for k, d in diff.items() if d > METRIC_RTOL}
    assert not off, off
    assert set(want_grads) == set(got_grads)
    scale = max(float(g.abs().max()) for g in want_grads.values())
    worst = max(float((want_grads[k] - got_grads[k]).abs().max()) for k in want_grads)
    print(f"\n{case}: grad_norm {want['actor/grad_norm']:.6g} vs {got['actor/grad_norm']:.6g}, "
          f"largest gradient difference {worst:.2e} of {scale:.2e}, largest metric difference "
          f"{max(diff.values()):.1e} ({max(diff, key=diff.get)})")
    assert scale > 1e-4 and worst <= GRAD_RTOL * scale, (worst, scale)


def test_bf16_compute_on_two_ranks_is_close_to_fp32_on_one(two_ranks):
    """FSDP2's mixed precision (bf16 compute, fp32 master weights and reductions): the same
    step within bf16's precision (measured: grad norm 1.2e-5 relative apart, pg_loss 5e-5,
    gradients 0.5% of the largest entry)."""
    one, out = two_ranks
    want, want_grads = one["token-mean"]
    got, got_grads = read_case(out, "token-mean-bf16")
    assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-3)
    assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], rel=1e-2)
    scale = max(float(g.abs().max()) for g in want_grads.values())
    worst = max(float((want_grads[k] - got_grads[k]).abs().max()) for k in want_grads)
    print(f"\nbf16: grad_norm {got['actor/grad_norm']:.6g} (fp32 {want['actor/grad_norm']:.6g}), "
          f"pg_loss {got['actor/pg_loss']:.6g} (fp32 {want['actor/pg_loss']:.6g}), largest "
          f"gradient difference {worst:.2e} of {scale:.2e}")
    assert worst <= 0.05 * scale, (worst, scale)
