"""A served reward model: a Hugging Face sequence-classification checkpoint with one label.

``[[reward.models]] kind = "reward_model"``: its scorer (``RewardModel``; its options,
``RewardModelConfig``, are the config's: ``actors/runtime/config/pools.py``). The text scored is the prompt's messages plus the response, through the
tokenizer's chat template when it has one (the response as the assistant's turn), else the
messages' contents and the response joined by newlines. The score is the label's logit at the
last token (as TRL and OpenRLHF reward models are trained), shifted and scaled by
``reward_mean``/``reward_std``.

A replica loads the model once and runs it on a worker thread, ``batch_size`` sequences per
forward (the items of concurrent requests together: ``actors/scoring/served.py``): it is the
job's own trusted checkpoint, not user code, and reloading it in a fresh child after every
timeout would cost more than the call. torch and transformers are imported only when a replica
loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from actors.runtime.config import RewardModelConfig
from actors.sandbox.protocol import Outcome
from actors.scoring.items import ScoreItem
from messages.rollout import ChatMessage


class RewardModel:
    """``cfg.path``'s checkpoint, scoring items in batches on a worker thread."""

    children = None  # no user code: nothing runs in a sandboxed child

    def __init__(self, cfg: RewardModelConfig) -> None:
        self.cfg = cfg
        self.device: Any = "cpu"  # where the model computes (set by load: the replica's device)
        self._model: Any = None  # loaded by load(); None until then
        self._tokenizer: Any = None

    async def load(self, device: Any) -> None:
        """Load the tokenizer and the model onto ``device`` (a worker thread does the work)."""
        from actors.runtime.devices import cap_memory

        cap_memory(device)  # a GPU shared with others: the runner's split
        self.device = device
        await anyio.to_thread.run_sync(self.load_sync)

    def load_sync(self) -> None:
        """Load the tokenizer and the model (blocking: call it on a worker thread)."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(self.cfg.threads)
        path = Path(self.cfg.path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        if model.config.num_labels != 1:
            raise ValueError(f"{path}: {model.config.num_labels} labels; a reward model has one")
        if tokenizer.pad_token_id is None:  # the last real token is found by its padding
            if self.cfg.batch_size > 1:
                raise ValueError(f"{path}: the tokenizer has no pad token, so batch_size must be 1")
        elif model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"  # keep the end of the response, where the score is read
        self._model, self._tokenizer = model.to(self.device).eval(), tokenizer

    @property
    def module(self) -> Any:
        """The loaded torch model (None before ``load``): what sleeps."""
        return self._model

    def text(self, item: ScoreItem) -> str:
        """What the model reads for one item."""
        from actors.data.chat import chat_text

        if self._tokenizer.chat_template:
            return chat_text(self._tokenizer,
                             [*item.prompt, ChatMessage("assistant", item.solution_str)])
        return "\n".join([m.content for m in item.prompt] + [item.solution_str])

    def score_sync(self, items: list[ScoreItem]) -> list[float]:
        """Scores of ``items`` in order, ``batch_size`` at a time (blocking)."""
        import torch

        if self._model is None:
            self.load_sync()
        templated = bool(self._tokenizer.chat_template)
        scores: list[float] = []
        for start in range(0, len(items), self.cfg.batch_size):
            texts = [self.text(item) for item in items[start:start + self.cfg.batch_size]]
            batch = self._tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                                    max_length=self.cfg.max_length,
                                    add_special_tokens=not templated)  # the template has them
            with torch.inference_mode():
                logits = self._model(input_ids=batch["input_ids"].to(self.device),
                                     attention_mask=batch["attention_mask"].to(self.device)
                                     ).logits  # (B, 1)
            scores += ((logits[:, 0].float() - self.cfg.reward_mean) / self.cfg.reward_std).tolist()
        return scores

    async def score(self, items: list[ScoreItem]) -> list[Outcome]:
        """One outcome per item, computed on a worker thread; a failure is every item's error."""
        try:
            scores = await anyio.to_thread.run_sync(self.score_sync, items)
        except Exception as exc:  # a scorer's fault is a recorded error, never a dead worker
            return [Outcome(error=f"reward model: {type(exc).__name__}: {exc}"[:500])] * len(items)
        return [Outcome(score=s) for s in scores]

    def status(self) -> dict[str, Any]:
        return {}

    async def aclose(self) -> None:
        pass
