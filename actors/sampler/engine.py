"""The CPU generation engine: transformers ``generate`` plus behaviour log-probs per token.

The behaviour log-prob of a token is ``log_softmax(logits / temperature)`` at that token, before
top-p/top-k truncation: the same quantity the learner recomputes, so importance ratios compare
like with like (vLLM's ``processed_logprobs`` convention minus the truncation).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from actors.runtime.config import SamplerConfig
from kernels.logprobs import token_logprobs


@dataclass
class Completion:
    response_ids: torch.Tensor  # (R,) int32
    logprobs: torch.Tensor  # (R,) float32
    text: str
    finish_reason: str  # "stop" or "length"


class _Abort(StoppingCriteria):
    """Ends generation early when the actor is stopping (checked once per token)."""

    def __init__(self, flag: threading.Event) -> None:
        self.flag = flag

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool)


class HFEngine:
    """Holds the policy weights of one sampler and generates groups of completions."""

    def __init__(self, model_path: Path, cfg: SamplerConfig, dtype: str, seed: int) -> None:
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.eval()
        self.params = dict(self.model.named_parameters())
        self.generator_seed = seed
        self.abort = threading.Event()
        torch.manual_seed(seed)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, *, greedy: bool = False
                 ) -> list[list[Completion]]:
        """``n`` completions for each tokenized prompt (left-padded into one batch).

        ``greedy`` decodes the most likely tokens instead of sampling (remax's baseline).
        """
        cfg, tok = self.cfg, self.tokenizer
        width = max(len(p) for p in prompts)
        pad = tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        ids, attn = ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)  # (B·n, P)
        out = self.model.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=cfg.max_tokens,
            **({"do_sample": False, "temperature": None, "top_p": None, "top_k": None} if greedy else
               {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p,
                "top_k": cfg.top_k or None}),
            pad_token_id=pad, eos_token_id=tok.eos_token_id, output_logits=True,
            return_dict_in_generate=True, stop_strings=cfg.stop or None,
            tokenizer=tok if cfg.stop else None,
            stopping_criteria=StoppingCriteriaList([_Abort(self.abort)]),
        )
        seqs = out.sequences[:, width:]  # (B·n, R)
        logits = torch.stack(out.logits, 1)  # (B·n, R, V) raw logits of each step
        lps = token_logprobs(logits, seqs, 1.0 if greedy else cfg.temperature,
                             chunk_size=1024)  # (B·n, R), the learner's quantity
        groups: list[list[Completion]] = [[] for _ in prompts]
        for row in range(seqs.shape[0]):
            length, reason = self._length(seqs[row])
            resp = seqs[row, :length]
            text = tok.decode(resp, skip_special_tokens=True)
            groups[row // n].append(Completion(resp.to(torch.int32), lps[row, :length].clone(),
                                               text, reason))
        return groups

    def _length(self, seq: torch.Tensor) -> tuple[int, str]:
        """Tokens the model generated: up to and including the first EOS, or a stop string."""
        eos = (seq == self.tokenizer.eos_token_id).nonzero()
        if len(eos):
            return int(eos[0]) + 1, "stop"
        if self.cfg.stop:
            text = self.tokenizer.decode(seq, skip_special_tokens=True)
            if any(s in text for s in self.cfg.stop):
                # generate stopped on a stop string: everything it produced belongs to the sample
                pads = (seq == self.tokenizer.pad_token_id).nonzero()
                return (int(pads[0]) if len(pads) else len(seq)), "stop"
        return len(seq), "length"

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy new weights into the live model (names as in ``named_parameters``)."""
        unknown = set(tensors) - set(self.params)
        if unknown:
            raise KeyError(f"weights for unknown parameters: {sorted(unknown)[:5]}")
        for name, value in tensors.items():
            self.params[name].copy_(value)
