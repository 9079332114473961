"""The learner's side of vision-language models: a batch's images as pixel tensors, and the
model's inputs (image features in the embeddings, 3-D M-RoPE positions) padded or packed.

The pixel tensors are rebuilt from the prompt's encoded images with the model's own processor
(``actors/data/vision.py``), exactly as the sampler built them for its engine, so the learner's
log-probs see the input the behaviour log-probs saw.

The forward does what the model's own ``forward`` does with ``pixel_values`` (the vision tower's
features scattered over the image tokens; positions from the model's ``get_rope_index``), with
two differences that keep it right for training rows:

- only image tokens of the prompt take features: a response token that happens to be the image
  token (a policy may sample it) is an ordinary token, as it was when it was generated;
- packed rows get each sequence's own positions (``get_rope_index`` per row, taken from the
  padded layout) stacked under the per-sequence text positions, transformers' ``(4, 1, T)``
  packed M-RoPE form, so attention stays within each sequence and every token keeps the
  position it has in the padded row: the packed step equals the padded one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.data.vision import ImageProcessor, in_vision_tower
from actors.runtime.tensors import from_wire
from messages.control import ImageSample
from messages.rollout import ScoredGroup


@dataclass
class VisionRows:
    """The images of a batch's rows: each row's images' patches, rows in order."""

    pixel_values: torch.Tensor  # (P, D) float, the patches of every row's images, row by row
    image_grid_thw: torch.Tensor  # (K, 3) long, each image's grid, row by row
    images_per_row: torch.Tensor  # (N,) long
    prompt_lengths: torch.Tensor  # (N,) long: image tokens count only inside the prompt

    def rows(self, index: slice) -> VisionRows | None:
        """The images of rows ``index`` (None: those rows have none)."""
        start, stop, _ = index.indices(len(self.images_per_row))
        first = int(self.images_per_row[:start].sum())
        last = first + int(self.images_per_row[start:stop].sum())
        if last == first:
            return None
        patches = self.image_grid_thw.prod(-1)  # (K,)
        lo, hi = int(patches[:first].sum()), int(patches[:last].sum())
        return VisionRows(self.pixel_values[lo:hi], self.image_grid_thw[first:last],
                          self.images_per_row[index], self.prompt_lengths[index])

    def patches(self, index: slice) -> int:
        """Image patches of rows ``index`` (what the vision tower runs over for them)."""
        rows = self.rows(index)
        return 0 if rows is None else int(rows.image_grid_thw.prod(-1).sum())

    def to(self, device: torch.device) -> VisionRows:
        return VisionRows(self.pixel_values.to(device), self.image_grid_thw.to(device),
                          self.images_per_row.to(device), self.prompt_lengths.to(device))


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
            images = s.images if own else g.prompt.images
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
    out = []
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


def image_token_mask(model, input_ids: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
    """(B, W) bool: the image tokens inside each row's prompt."""
    cols = torch.arange(input_ids.shape[1], device=input_ids.device)
    inside = cols.unsqueeze(0) < prompt_lengths.unsqueeze(1)
    return (input_ids == model.config.image_token_id) & inside


def rope_positions(base, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   vision: VisionRows) -> torch.Tensor:
    """(3, B, W) M-RoPE positions of right-padded rows, from the model's ``get_rope_index``."""
    types = image_token_mask(base, input_ids, vision.prompt_lengths).int()
    positions, _ = base.get_rope_index(input_ids, mm_token_type_ids=types,
                                       image_grid_thw=vision.image_grid_thw,
                                       attention_mask=attention_mask)
    return positions


def embeddings(base, input_ids: torch.Tensor, vision: VisionRows,
               where: torch.Tensor) -> torch.Tensor:
    """Token embeddings (..., H) of ``input_ids`` with the images' features over the image
    tokens ``where`` (same shape as ``input_ids``)."""
    embeds = base.get_input_embeddings()(input_ids)
    features = base.get_image_features(vision.pixel_values, vision.image_grid_thw,
                                       return_dict=True).pooler_output
    features = torch.cat(features, dim=0).to(embeds.dtype)  # (image tokens, H)
    if int(where.sum()) != features.shape[0]:
        raise ValueError(f"image features and image tokens do not match: {int(where.sum())} "
                         f"image tokens in the prompts, {features.shape[0]} features")
    return embeds.masked_scatter(where.unsqueeze(-1), features)


def idle_tower(base) -> torch.Tensor:
    """A scalar 0 computed through the vision tower from one blank image of the smallest grid.
    Added to a forward without images on a learner of several ranks, it makes the tower run
    forward and backward there too: FSDP gathers a sharded block's parameters and reduces its
    gradients in collectives every rank must join, and a rank whose micro-batch has no image
    would otherwise leave the others waiting (gloo: a collective mismatch). Its gradients are
    exact zeros, so the step is the one rank's."""
    vc = base.config.vision_config
    m = int(vc.spatial_merge_size)
    width = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
    device = next(base.visual.parameters()).device
    pixels = torch.zeros(m * m, width, device=device)  # (patches, C·T·p²): m x m patches
    grid = torch.tensor([[1, m, m]], device=device)
    features = base.get_image_features(pixels, grid, return_dict=True).pooler_output
    return 0 * torch.cat(features).sum()


def padded_inputs(base, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  vision: VisionRows) -> dict:
    """The keyword arguments of the base model's forward over right-padded rows (B, W)."""
    where = image_token_mask(base, input_ids, vision.prompt_lengths)
    return dict(inputs_embeds=embeddings(base, input_ids, vision, where),
                attention_mask=attention_mask,
                position_ids=rope_positions(base, input_ids, attention_mask, vision),
                use_cache=False)


def packed_positions(base, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     vision: VisionRows) -> torch.Tensor:
    """(4, 1, T) positions of the rows packed: per-sequence text positions (restarting at 0),
    then the three M-RoPE rows each sequence has in the padded layout."""
    keep = attention_mask.bool()  # right padding: each row's tokens first
    rope = rope_positions(base, input_ids, attention_mask, vision)[:, keep]  # (3, T)
    cols = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)[keep]
    return torch.cat([cols.unsqueeze(0), rope]).unsqueeze(1)  # (4, 1, T)


def packed_embeddings(base, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      vision: VisionRows) -> torch.Tensor:
    """(1, T, H) embeddings of the rows packed (the images' features in place)."""
    keep = attention_mask.bool()
    where = image_token_mask(base, input_ids, vision.prompt_lengths)[keep].unsqueeze(0)  # (1, T)
    return embeddings(base, input_ids[keep].unsqueeze(0), vision, where)
