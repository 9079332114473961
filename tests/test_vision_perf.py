"""A vision-language step's cost counts its vision tower: ``perf/tflops/actor`` takes the tower's
FLOPs over the batch's image patches (a forward when the tower is frozen, forward and backward
when it trains), and the memory estimate its activations, against what autograd saves."""

from __future__ import annotations

import pytest
import torch

from actors.data.vision import ImageProcessor
from actors.learner.batch import build_batch
from actors.learner.memory import estimate, saved_bytes
from actors.learner.packing import own_tokens
from actors.learner.perf import train_flops, vision_tower
from actors.model_store import PolicyModel
from tests.learner_cases import make_trainer
from tests.test_vision import PROMPTS, engine_groups
from tests.tiny_vlm import solid_png

OPTS = ("algorithm.n=2", "learner.groups_per_step=4")


def step_flops(metrics: dict[str, float]) -> float:
    """The FLOPs behind ``perf/tflops/actor`` (one epoch, one rank): rate x update time."""
    return metrics["perf/tflops/actor"] * 1e12 * metrics["timing_s/update_actor"]


def test_a_vlm_steps_flops_count_the_vision_tower_over_its_patches(tiny_vlm, tmp_path):
    groups = engine_groups(tiny_vlm, PROMPTS)
    trained = make_trainer(tiny_vlm, tmp_path / "trains", *OPTS)
    frozen = make_trainer(tiny_vlm, tmp_path / "frozen", *OPTS, "model.freeze_vision=true")
    batch = build_batch(groups, 0, ImageProcessor(tiny_vlm))
    text = train_flops(trained.policy.model.config.get_text_config(),  # the tokens read
                       own_tokens(batch.attention_mask.sum(1).tolist(), batch.shared))
    patches = int(batch.vision.image_grid_thw.prod(-1).sum())  # every row's images
    tower = trained.policy.model.model.visual
    params = sum(p.numel() for p in tower.parameters() if p.dim() >= 2)
    forward = 2 * params * patches
    extra = step_flops(trained.train_step(groups)) - text
    extra_frozen = step_flops(frozen.train_step(groups)) - text
    print(f"\ntext {text:.3e} FLOPs; the tower over {patches} patches: {extra:.3e} training, "
          f"{extra_frozen:.3e} frozen; 2·params·patches = {forward:.3e}")
    # the merger runs on merged tokens (a quarter of the patches): below 2·N·P, its order
    assert forward / 2 < extra_frozen < forward * 2
    assert extra == pytest.approx(3 * extra_frozen, rel=1e-6)  # backward: twice the forward
    assert vision_tower(frozen.policy.model).trains is False


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_memory_estimate_counts_the_vision_towers_activations(tiny_vlm, checkpointing):
    """The tower's share of the estimate within 10% of the bytes autograd saves for a forward
    over 8 images of 16 patches (the decoder's own share is ``tests/test_memory.py``'s); with
    checkpointing the estimate also counts the one block recomputed during backward, which the
    forward pass does not hold."""
    model = PolicyModel.from_pretrained(tiny_vlm, dtype=torch.float32)
    pixels = ImageProcessor(tiny_vlm).pixels([solid_png((9, 99, 199), 56)] * 8)
    patches = int(pixels.image_grid_thw.prod(-1).sum())
    tower = model.model.visual
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    real = saved_bytes(lambda: tower(pixels.pixel_values, grid_thw=pixels.image_grid_thw),
                       list(tower.parameters()))
    config, shape = model.config, vision_tower(model)
    without = estimate(config, tokens=64, checkpointing=checkpointing)
    counted = estimate(config, tokens=64, checkpointing=checkpointing, patches=patches,
                       tower=shape).activations - without.activations
    vc = config.vision_config
    if checkpointing:
        counted -= patches * (12 * vc.hidden_size + 4 * vc.intermediate_size) * 4
    print(f"\ncheckpointing {checkpointing}: {patches} patches, estimated {counted} B, "
          f"saved {real} B")
    assert abs(counted - real) <= 0.1 * real
    tower.requires_grad_(False)
    assert estimate(config, tokens=64, checkpointing=checkpointing, patches=patches,
                    tower=vision_tower(model)).activations == without.activations  # frozen
