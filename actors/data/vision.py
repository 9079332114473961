"""Images of vision-language prompts: placeholders, decoding, and the model's processor.

A prompt's images travel as encoded bytes (PNG, JPEG, ...: ``Prompt.images``) and its messages
keep verl's ``<image>`` placeholders in their text, one per image in order. Everything that turns
those into model inputs is here, so the sampler (the prompt's token ids, the engine's pixel
tensors) and the learner (the same pixel tensors, rebuilt from the same bytes) compute them one
way: behaviour and learner log-probs then see the same input.

The model's own processor expands each image's placeholder token into as many tokens as the
vision tower emits for it (Qwen2-VL family: ``grid_t·grid_h·grid_w / merge²``). transformers
assembles a Qwen2.5-VL ``AutoProcessor`` only with torchvision installed (for its video
processor), and the PyPI torchvision wheels are built for the CUDA torch; without it the
processor is assembled from its parts here (the image processor's PIL backend and the
tokenizer), which is all still images need.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from messages.rollout import ChatMessage

if TYPE_CHECKING:  # torch-free at import: the replay buffer reads datasets through this module
    import torch

PLACEHOLDER = "<image>"  # verl's (and the geometry3k preprocessing's) marker in a prompt's text


class ImageError(ValueError):
    """A prompt's images do not fit its text, or one cannot be read."""


def is_vision_model(path: str | Path) -> bool:
    """Whether the Hugging Face directory ``path`` holds a vision-language model (its config has
    a vision tower)."""
    import json

    config = Path(path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


def in_vision_tower(name: str) -> bool:
    """Whether the module or tensor ``name`` belongs to the vision tower (its merger included):
    the Qwen2-VL family keeps it under ``visual`` (``model.visual.blocks.0.attn.qkv``; older
    checkpoints ``visual.blocks...``)."""
    return "visual" in name.split(".")


def count_placeholders(messages: Sequence[ChatMessage]) -> int:
    return sum(m.content.count(PLACEHOLDER) for m in messages)


def check_images(messages: Sequence[ChatMessage], images: Sequence[bytes]) -> None:
    """Raise ``ImageError`` unless the messages hold one placeholder per image and every image
    decodes."""
    found = count_placeholders(messages)
    if found != len(images):
        raise ImageError(f"{found} {PLACEHOLDER} placeholder(s) in the prompt for "
                         f"{len(images)} image(s)")
    for k, data in enumerate(images):
        decode(data, k)


def decode(data: bytes, index: int = 0) -> Any:
    """Image ``index`` of a prompt as an RGB PIL image; ``ImageError`` when it is not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        # PIL names the in-memory file it was given (``<_io.BytesIO object at 0x...>``): noise
        why = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(exc))
        raise ImageError(f"image {index} ({len(data)} bytes) is not an image PIL can read: "
                         f"{why}") from None
    return image.convert("RGB")


def structured(messages: Sequence[ChatMessage],
               image_part: Callable[[int], dict[str, Any]] = lambda k: {"type": "image"},
               ) -> list[dict[str, Any]]:
    """The messages with structured content, as chat templates of vision-language models read
    them: each ``<image>`` placeholder an image part (``image_part(k)`` for the k-th of all the
    messages), the text between them text parts."""
    out: list[dict[str, Any]] = []
    k = 0
    for m in messages:
        if PLACEHOLDER not in m.content:
            out.append({"role": m.role, "content": m.content})
            continue
        parts: list[dict[str, Any]] = []
        for j, text in enumerate(m.content.split(PLACEHOLDER)):
            if j:
                parts.append(image_part(k))
                k += 1
            if text:
                parts.append({"type": "text", "text": text})
        out.append({"role": m.role, "content": parts})
    return out


@dataclass
class PixelInputs:
    """The vision tower's inputs for a list of images, in order."""

    pixel_values: torch.Tensor  # (patches, C·temporal·patch²) float, every image's patches
    image_grid_thw: torch.Tensor  # (K, 3) long, each image's (t, h, w) grid of patches


class ImageProcessor:
    """A vision-language model's processor: chat messages with placeholders and their images
    in, the prompt's token ids (image tokens expanded) and the pixel tensors out."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # the PIL backend wherever the code runs, installed torchvision or not: the sampler's and
        # the learner's pixels then come from one implementation of the resize
        self.image_processor = AutoImageProcessor.from_pretrained(model_path, backend="pil")
        self.image_token: str = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        token = self.tokenizer.convert_tokens_to_ids(self.image_token)
        if not isinstance(token, int) or token == self.tokenizer.unk_token_id:
            raise ValueError(f"{model_path}: the tokenizer has no {self.image_token} token: "
                             "not a Qwen2-VL-family model")
        self.image_token_id: int = token
        self.merge = int(getattr(self.image_processor, "merge_size", 2))

    def pixels(self, images: Sequence[bytes]) -> PixelInputs:
        """The pixel tensors of ``images`` (encoded bytes), as the model's processor makes them."""
        if not images:
            raise ImageError("no images")
        out = self.image_processor(images=[decode(d, k) for k, d in enumerate(images)],
                                   return_tensors="pt")
        return PixelInputs(out["pixel_values"], out["image_grid_thw"].long())

    def tokens_per_image(self, grid: torch.Tensor) -> list[int]:
        return (grid.prod(-1) // self.merge ** 2).tolist()

    def prompt_ids(self, messages: Sequence[ChatMessage], images: Sequence[bytes],
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of ``messages`` under the chat template with the generation prompt, each
        image's placeholder token repeated once per token its features fill."""
        check_images(messages, images)
        extra = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(structured(messages), add_generation_prompt=True,
                                                  tokenize=False, **extra)
        expanded = self.expand(str(text), images)
        return list(self.tokenizer(expanded, add_special_tokens=False)["input_ids"])

    def expand(self, text: str, images: Sequence[bytes]) -> str:
        """``text`` as a chat template renders it (one image token per image, in order) with
        each image's token repeated once per token its features fill: every prompt with images
        (a dataset's, an endpoint call's) is expanded here, so engine and learner count alike."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(images):
            raise ImageError(f"the chat template rendered {len(pieces) - 1} image token(s) for "
                             f"{len(images)} image(s)")
        if not images:
            return text
        counts = self.tokens_per_image(self.pixels(images).image_grid_thw)
        return pieces[0] + "".join(self.image_token * c + p
                                   for c, p in zip(counts, pieces[1:], strict=True))
