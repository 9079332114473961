"""The one place chat templates are applied: messages in, token ids (or text) out.

Prompts are templated and tokenized once, by the sampler's rollout (and by the replay buffer's
length filter, which must count the same tokens); an engine only ever sees token ids. Reward
models render a whole conversation as text with their own tokenizer's template.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from messages.rollout import ChatMessage, Prompt


def as_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def chat_ids(tokenizer: Any, messages: Sequence[ChatMessage],
             tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, ending with the generation
    prompt (the assistant's turn opened): what the model continues from. ``tools`` (JSON
    schemas) go to the template, for templates that render them."""
    extra = {"tools": tools} if tools else {}
    out = tokenizer.apply_chat_template(as_dicts(messages), add_generation_prompt=True,
                                        tokenize=True, return_dict=False, **extra)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def chat_text(tokenizer: Any, messages: Sequence[ChatMessage]) -> str:
    """A whole conversation rendered as text by the tokenizer's chat template (no generation
    prompt): what a reward model reads."""
    return str(tokenizer.apply_chat_template(as_dicts(messages), tokenize=False))


class ChatTokenizer:
    """A model's tokenizer: prompts to token ids (chat template applied once), ids to text."""

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoTokenizer

        from actors.data.vision import ImageProcessor, is_vision_model

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # a vision-language model's processor renders prompts that carry images
        self.processor = ImageProcessor(model_path) if is_vision_model(model_path) else None
        self.eos_token_id: int = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = self.eos_token_id if pad is None else pad

    def prompt_ids(self, messages: Sequence[ChatMessage],
                   tools: list[dict[str, Any]] | None = None,
                   images: Sequence[bytes] = ()) -> list[int]:
        """The prompt's token ids; with ``images``, each image's tokens expanded by the model's
        processor (``actors/data/vision.py``)."""
        if images:
            if self.processor is None:
                raise ValueError("a prompt with images for a model without a vision tower")
            return self.processor.prompt_ids(messages, images, tools)
        return chat_ids(self.tokenizer, messages, tools)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of generated tokens, special tokens (EOS) left out."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))  # typed str | list


def prompt_token_counter(model_path: str) -> Callable[[Prompt], int]:
    """Tokens of a prompt as the sampler feeds it: the model's chat template with the
    generation prompt (what verl's ``data.max_prompt_length`` filter counts)."""
    from actors.model_store import resolve_model_path

    tokenizer = ChatTokenizer(resolve_model_path(model_path))
    return lambda prompt: len(tokenizer.prompt_ids(prompt.messages, images=prompt.images))
