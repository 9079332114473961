"""The learner's side of vision-language models: a batch's images as pixel tensors, the
vision tower's training switches (frozen, LoRA targets), and the images the trackers show.

The pixel tensors are rebuilt from the prompt's encoded images with the model's own processor
(``actors/data/vision.py``), exactly as the sampler built them for its engine, so the learner's
log-probs see the input the behaviour log-probs saw; the forward over them is
``actors/data/vision_inputs.py``.
"""

from __future__ import annotations

import torch

from actors.data.vision import ImageProcessor, in_vision_tower
from actors.data.vision_inputs import VisionRows
from actors.runtime.tensors import from_wire
from messages.control import ImageSample
from messages.rollout import Sample, ScoredGroup


def row_images(group: ScoredGroup, sample: Sample) -> list[bytes]:
    """The images of a sample's row: its own prompt's (an endpoint call's) or its group's."""
    return sample.images if sample.prompt_ids is not None else group.prompt.images


def vision_rows(groups: list[ScoredGroup], processor: ImageProcessor | None) -> VisionRows | None:
    """The images of a batch built from ``groups`` (rows as ``build_batch`` orders them), or
    None when no prompt has any. Each group's images are processed once and repeated for its
    samples; a sample with a prompt of its own (an endpoint call's) has its own images."""
    if not any(g.prompt.images or any(s.images for s in g.samples) for g in groups):
        return None
    if processor is None:
        raise ValueError("a batch with images for a model without a vision tower")
    pixels, grids, per_row, lengths = [], [], [], []
    for g in groups:
        shared = processor.pixels(g.prompt.images) if g.prompt.images else None
        for s in g.samples:
            own = s.prompt_ids is not None
            images = row_images(g, s)
            inputs = (processor.pixels(images) if images else None) if own else shared
            per_row.append(len(images))
            lengths.append((g.prompt_ids if s.prompt_ids is None else s.prompt_ids).shape[0])
            if inputs is not None:
                pixels.append(inputs.pixel_values)
                grids.append(inputs.image_grid_thw)
    return VisionRows(torch.cat(pixels), torch.cat(grids), torch.tensor(per_row),
                      torch.tensor(lengths))


def freeze_vision_tower(model) -> int:
    """Stop training ``model``'s vision tower (``model.freeze_vision``); returns how many
    parameters were frozen. A model without one is an error naming the key."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    tower = getattr(core.base_model, "visual", None)
    if tower is None:
        raise ValueError("model.freeze_vision: the model has no vision tower")
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def image_samples(groups: list[ScoredGroup], tokenizer, count: int) -> list[ImageSample]:
    """The first sample of each of the first ``count`` groups whose prompt has images, with
    its decoded answer and reward: what the trackers show of a step (``run.image_samples``)."""
    out: list[ImageSample] = []
    for g in groups:
        if len(out) == count:
            break
        if g.prompt.images and g.samples:
            s = g.samples[0]
            answer = tokenizer.decode(from_wire(s.response_ids).tolist(), skip_special_tokens=True)
            out.append(ImageSample(list(g.prompt.images), answer, float(s.reward),
                                   g.prompt.prompt_id))
    return out


def lora_targets(model, names: tuple[str, ...], vision: bool) -> list[str]:
    """PEFT's ``target_modules`` for ``learner.lora``: ``names`` as given for a text model; for
    a vision-language model the full name of every linear layer they name in its language model
    (PEFT matches names as suffixes, and the Qwen2.5-VL tower's MLP has ``gate_proj``,
    ``up_proj`` and ``down_proj`` too: left to suffixes, the tower would get adapters the
    samplers' vLLM never applies without its tower LoRA), and with ``vision`` every linear layer
    of the tower. Full names go to the samplers as they are (``AdapterSpec.target_modules``)."""
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if not any(in_vision_tower(n) for n, _ in modules):
        return list(names)
    return [n for n, _ in modules
            if (vision if in_vision_tower(n) else
                any(n == t or n.endswith(f".{t}") for t in names))]
