"""A vision-language learner as two ranks (FSDP2 over gloo, two CPU processes) against one rank:
the same step on a batch with images, as ``tests/test_learner_ranks.py`` shows for text.

The batch's last prompt has no image, so one rank's last micro-batch has none while the other
rank's have images: the vision tower's blocks are sharded units whose gathers and gradient
reductions are collectives, which the rank without images joins through ``idle_tower``."""

from __future__ import annotations

import json

import msgspec
import pytest
from safetensors.torch import load_file

from tests.learner_cases import with_behaviour
from tests.rank_cases import CASES
from tests.test_learner import captured_gradients
from tests.test_learner_ranks import GRAD_RTOL, LIVE, METRIC_RTOL, one_rank_trainer, run_ranks
from tests.test_vision import PROMPTS, engine_groups

CASE = "token-mean"


@pytest.mark.slow
def test_two_ranks_take_the_vlm_step_of_one(tiny_vlm, tmp_path):
    """Kept gathered (the CPU's way) and resharded after each forward (the GPU's)."""
    one = one_rank_trainer(tiny_vlm, tmp_path / "one", CASES[CASE])
    groups = with_behaviour(one, engine_groups(tiny_vlm, PROMPTS, n=4), lambda s, own: own - 0.3)
    assert not groups[-1].prompt.images and all(g.prompt.images for g in groups[:-1])
    groups_file = tmp_path / "groups.msgpack"
    groups_file.write_bytes(msgspec.msgpack.encode(groups))
    run_ranks(tiny_vlm, groups_file, tmp_path, [CASE, f"{CASE}-resharded"], timeout=300)
    grads = captured_gradients(one)
    want = one.train_step(groups)
    scale = max(float(g.abs().max()) for g in grads.values())
    tower = max(float(g.abs().max()) for k, g in grads.items() if ".visual." in k)
    assert tower > 0 and scale > 1e-4
    for case in (CASE, f"{CASE}-resharded"):
        got = json.loads((tmp_path / f"{case}.json").read_text())
        got_grads = load_file(tmp_path / f"{case}.safetensors")
        compared = [k for k in want if not k.startswith(LIVE)]
        assert sorted(compared) == sorted(k for k in got if not k.startswith(LIVE))
        diff = {k: abs(want[k] - got[k]) / max(1.0, abs(want[k])) for k in compared}
        assert not {k: (want[k], got[k]) for k, d in diff.items() if d > METRIC_RTOL}
        assert set(grads) == set(got_grads)
        worst = max(float((grads[k] - got_grads[k]).abs().max()) for k in grads)
        print(f"\n{case}: grad_norm {want['actor/grad_norm']:.6g} vs {got['actor/grad_norm']:.6g}"
              f", largest gradient difference {worst:.2e} of {scale:.2e} (the tower's largest "
              f"{tower:.2e}), largest metric difference {max(diff.values()):.1e}")
        assert worst <= GRAD_RTOL * scale, (case, worst, scale)
