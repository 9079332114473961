"""A vision-language prompt as vLLM takes it: token ids with the images beside them.

The sampler's prompt ids hold each image's token already expanded, once per token its features
fill (``actors/data/vision.py``). vLLM 0.32 expands placeholders itself on every token prompt
with ``multi_modal_data`` (its multi-modal processor replaces each ``<|image_pad|>`` it finds by
as many as the image needs, and never checks whether that was done already), so an expanded
prompt would be expanded twice. ``tokens_prompt`` therefore sends each image's run of image
tokens as one token, and ``check_expanded`` compares vLLM's expansion with the sampler's: the
behaviour log-probs are computed on vLLM's, the learner's on the sampler's, and the two must
be the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def image_token_id(model_path: str | Path) -> int | None:
    """The image token of the model at ``model_path`` (``image_token_id`` in its config); None
    for a text model."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("image_token_id")
    return None if value is None else int(value)


def collapse(prompt_ids: Sequence[int], token: int, images: int) -> list[int]:
    """``prompt_ids`` with every run of ``token`` cut to one token: the form vLLM expands.
    Raises ValueError unless there is one run per image."""
    out: list[int] = []
    runs = 0
    for i, t in enumerate(prompt_ids):
        if t == token and i and prompt_ids[i - 1] == token:
            continue
        runs += t == token
        out.append(t)
    if runs != images:
        raise ValueError(f"the prompt has {runs} run(s) of image tokens for {images} image(s)")
    return out


def tokens_prompt(prompt_ids: Sequence[int], images: Sequence[Any], token: int | None
                  ) -> dict[str, Any]:
    """vLLM's ``TokensPrompt`` for ``prompt_ids`` and its decoded ``images`` (PIL images, in the
    order of their placeholders); a text prompt when there are none."""
    if not images:
        return {"prompt_token_ids": list(prompt_ids)}
    if token is None:
        raise ValueError("a prompt with images for a model without an image token "
                         "(its config.json has no image_token_id)")
    return {"prompt_token_ids": collapse(prompt_ids, token, len(images)),
            "multi_modal_data": {"image": list(images)}}


def check_expanded(sent: Sequence[int], engine: Sequence[int] | None) -> None:
    """Raise ValueError when vLLM expanded the image tokens into other prompt ids than the
    sampler's (``sent``): its processor resized the images differently (another
    ``min_pixels`` / ``max_pixels``), and the learner would score other inputs."""
    if engine is not None and list(engine) != list(sent):
        raise ValueError(f"vLLM expanded the prompt's images into {len(engine)} prompt tokens, "
                         f"the sampler into {len(sent)}: its image processor and the model "
                         "directory's disagree")
