"""A vision-language model's forward inputs for training rows: the images' features in the
token embeddings and 3-D M-RoPE positions, padded or packed. The learner's objective and the
teacher's log-probs both run them, so a teacher scores a prompt's images as the learner does.

This does what the model's own ``forward`` does with ``pixel_values`` (the vision tower's
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


def image_features(base, vision: VisionRows, tokens: int) -> torch.Tensor:
    """(image tokens, H): the vision tower's features of every image of ``vision``, image by
    image, for ``tokens`` image tokens in the rows' prompts."""
    features = base.get_image_features(vision.pixel_values, vision.image_grid_thw,
                                       return_dict=True).pooler_output
    features = torch.cat(features, dim=0)  # (image tokens, H)
    if tokens != features.shape[0]:
        raise ValueError(f"image features and image tokens do not match: {tokens} image "
                         f"tokens in the prompts, {features.shape[0]} features")
    return features


def embeddings(base, input_ids: torch.Tensor, vision: VisionRows,
               where: torch.Tensor) -> torch.Tensor:
    """Token embeddings (..., H) of ``input_ids`` with the images' features over the image
    tokens ``where`` (same shape as ``input_ids``)."""
    embeds = base.get_input_embeddings()(input_ids)
    features = image_features(base, vision, int(where.sum())).to(embeds.dtype)
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
                     vision: VisionRows, source: torch.Tensor) -> torch.Tensor:
    """(4, 1, T) positions of right-padded rows ``input_ids`` (B, W) packed, each packed token
    read from its place ``source`` (T,) in ``input_ids.flatten()`` (``PackedRows.source``): its
    column in its row (the text positions, restarting at 0 for each sequence, a shared prefix's
    rests continuing from its end), then the three M-RoPE rows it has in the padded layout."""
    rope = rope_positions(base, input_ids, attention_mask, vision).flatten(1)[:, source]  # (3, T)
    text = (source % input_ids.shape[1]).unsqueeze(0)  # (1, T)
    return torch.cat([text, rope]).unsqueeze(1)  # (4, 1, T)


def packed_embeddings(base, input_ids: torch.Tensor, vision: VisionRows,
                      source: torch.Tensor) -> torch.Tensor:
    """(1, T, H) embeddings of the rows packed (``source`` as for ``packed_positions``), the
    images' features over their tokens. A prefix its rows share is packed once: its image
    tokens take the features of the copy in the group's first row, and the other rows' copies
    take no gradient (the prefix's tokens carry every row's), so the tower's gradient is the
    unshared one."""
    where_all = image_token_mask(base, input_ids, vision.prompt_lengths).flatten()  # (B·W,)
    where = where_all[source]  # (T,) the packed image tokens
    embeds = base.get_input_embeddings()(input_ids.flatten()[source]).unsqueeze(0)  # (1, T, H)
    features = image_features(base, vision, int(where_all.sum())).to(embeds.dtype)
    rank = torch.cumsum(where_all, 0) - 1  # (B·W,) each image token's row in ``features``
    return embeds.masked_scatter(where.view(1, -1, 1), features[rank[source[where]]])
