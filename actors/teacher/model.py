"""The teacher's model: per-token log-probs of given token ids, no full-vocabulary logits kept.

For each response, the sequence ``prompt + response`` runs through the model's body; the hidden
states at the positions that predict the response tokens go through the LM head in chunks
(``kernels.lm_head_logprobs``: the fused Triton path on CUDA, the chunked one elsewhere), so
only a few ``(chunk, V)`` blocks exist at once, never ``(tokens, V)`` logits. Temperature 1:
the teacher's own distribution, as Tinker's and verl's teacher servers return it.

A vision-language teacher reads the prompt's images: their pixel tensors come from its
processor (``actors/data/vision.py``) and its forward takes them as the learner's does
(``actors/data/vision_inputs.py``: features over the prompt's image tokens, M-RoPE positions),
so a teacher with the student's weights gives the learner's log-probs. The student's prompt tokens
hold each image's tokens as the student's processor expanded them; a teacher whose processor
counts another number of tokens for an image is an error naming both counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from actors.data.vision_inputs import VisionRows, padded_inputs
from actors.runtime.devices import cap_memory, resolve_device, resolve_dtype
from kernels.lm_head_logprobs import lm_head_logprobs


class TeacherModel:
    """A causal LM loaded once; ``logprobs`` is blocking (call it on a worker thread)."""

    def __init__(self, path: Path, *, device: str, dtype: str, model_dtype: str, threads: int,
                 batch_size: int) -> None:
        self.path, self.batch_size, self.threads = path, batch_size, threads
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, model_dtype)
        self._model: Any = None  # loaded by load()
        self.processor: Any = None  # a vision-language teacher's ImageProcessor (set by load)
        self.pad_id = 0

    def load(self) -> None:
        from actors.data.vision import ImageProcessor, is_vision_model
        from actors.model_store import PolicyModel

        torch.set_num_threads(self.threads)
        cap_memory(self.device)
        model = PolicyModel.from_pretrained(self.path, dtype=self.dtype)  # a VLM's class too
        self.processor = ImageProcessor(self.path) if is_vision_model(self.path) else None
        head = model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"{self.path}: LM heads with a bias are not supported by the "
                             "log-prob kernels")
        pad = getattr(model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self._model = model.to(self.device).eval()

    @property
    def module(self) -> Any:
        """The loaded torch model (None before ``load``)."""
        return self._model

    def logprobs(self, prompt: list[int], responses: list[list[int]],
                 images: list[bytes] | None = None) -> list[torch.Tensor]:
        """``log π_teacher`` of each response token given the prompt (with its ``images``) and
        the tokens before it, one ``(R_i,)`` float32 CPU tensor per response, in order."""
        pixels = self._pixels(prompt, images) if images else None
        out: list[torch.Tensor] = []
        for start in range(0, len(responses), self.batch_size):
            out += self._batch(prompt, responses[start:start + self.batch_size], pixels)
        return out

    def _pixels(self, prompt: list[int], images: list[bytes]) -> Any:
        """The images' pixel tensors, checked against the prompt's image tokens."""
        if self.processor is None:
            raise ValueError("a prompt with images for a text-only teacher (its config.json has "
                             "no vision tower)")
        pixels = self.processor.pixels(images)
        want = sum(self.processor.tokens_per_image(pixels.image_grid_thw))
        have = prompt.count(self.processor.image_token_id)
        if want != have:
            raise ValueError(f"the prompt has {have} image tokens and the teacher's processor "
                             f"makes {want} for its {len(images)} image(s): teacher and student "
                             "must process images alike")
        return pixels

    @torch.inference_mode()
    def _batch(self, prompt: list[int], responses: list[list[int]],
               pixels: Any = None) -> list[torch.Tensor]:
        P = len(prompt)
        width = P + max(len(r) for r in responses)
        N = len(responses)
        ids = torch.full((N, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((N, width), dtype=torch.long)
        at = torch.zeros((N, width - 1), dtype=torch.bool)  # column t predicts token t + 1
        for i, r in enumerate(responses):
            ids[i, :P + len(r)] = torch.tensor(prompt + r, dtype=torch.long)
            attn[i, :P + len(r)] = 1
            at[i, P - 1:P - 1 + len(r)] = True
        ids, attn, at = ids.to(self.device), attn.to(self.device), at.to(self.device)
        model = self._model
        if pixels is None:
            inputs = dict(input_ids=ids, attention_mask=attn)
        else:  # every row the same prompt: its images once per row
            K = pixels.image_grid_thw.shape[0]
            vision = VisionRows(pixels.pixel_values.repeat(N, 1).to(self.device, self.dtype),
                                pixels.image_grid_thw.repeat(N, 1).to(self.device),
                                torch.full((N,), K, device=self.device),
                                torch.full((N,), P, device=self.device))
            inputs = padded_inputs(model.base_model, ids, attn, vision)
        hidden = model.base_model(**inputs).last_hidden_state
        hidden, targets = hidden[:, :-1][at], ids[:, 1:][at]  # (R, H), (R,)
        lp = lm_head_logprobs(hidden, model.get_output_embeddings().weight, targets)  # (R,)
        lp = lp.float().cpu()
        return list(lp.split([len(r) for r in responses]))
