"""The teacher's model: per-token log-probs of given token ids, no full-vocabulary logits kept.

For each response, the sequence ``prompt + response`` runs through the model's body; the hidden
states at the positions that predict the response tokens go through the LM head in chunks
(``kernels.lm_head_logprobs``: the fused Triton path on CUDA, the chunked one elsewhere), so
only a few ``(chunk, V)`` blocks exist at once, never ``(tokens, V)`` logits. Temperature 1:
the teacher's own distribution, as Tinker's and verl's teacher servers return it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

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
        self.pad_id = 0

    def load(self) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(self.threads)
        cap_memory(self.device)
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype)
        head = model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"{self.path}: LM heads with a bias are not supported by the "
                             "log-prob kernels")
        pad = model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self._model = model.to(self.device).eval()

    @property
    def module(self) -> Any:
        """The loaded torch model (None before ``load``)."""
        return self._model

    def logprobs(self, prompt: list[int], responses: list[list[int]]) -> list[torch.Tensor]:
        """``log π_teacher`` of each response token given the prompt and the tokens before it,
        one ``(R_i,)`` float32 CPU tensor per response, in order."""
        out: list[torch.Tensor] = []
        for start in range(0, len(responses), self.batch_size):
            out += self._batch(prompt, responses[start:start + self.batch_size])
        return out

    @torch.inference_mode()
    def _batch(self, prompt: list[int], responses: list[list[int]]) -> list[torch.Tensor]:
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
        hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
        hidden, targets = hidden[:, :-1][at], ids[:, 1:][at]  # (R, H), (R,)
        lp = lm_head_logprobs(hidden, model.get_output_embeddings().weight, targets)  # (R,)
        lp = lp.float().cpu()
        return list(lp.split([len(r) for r in responses]))
