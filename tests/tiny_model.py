"""A tiny random-weight llama and a character tokenizer with a chat template, built in seconds.

Plumbing tests run the real actors on this model instead of the 135M default.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 +=?\n")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


VOCAB = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}


def tiny_tokenizer(words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """The character tokenizer; ``words`` become single (not special) tokens after the rest,
    e.g. the tags of a tool-call format, so a random model can write them by chance."""
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    if words:
        tok.add_tokens(list(words))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   bos_token=None, unk_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(hidden: int = 64, layers: int = 2, words: int = 0, **extra) -> LlamaConfig:
    return LlamaConfig(vocab_size=len(VOCAB) + words, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, pad_token_id=0,
                       eos_token_id=VOCAB["<|im_end|>"], bos_token_id=None, **extra)


def build_tiny_model(path: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2,
                     words: tuple[str, ...] = ()) -> Path:
    fast = tiny_tokenizer(words)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(hidden, layers, len(words), tie_word_embeddings=True))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


def build_tiny_reward_model(path: Path, *, seed: int = 0) -> Path:
    """A random one-label ``LlamaForSequenceClassification`` (a reward model) and the tokenizer."""
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(tiny_config(num_labels=1))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def build_peaked_model(path: Path, *, token: str = "a", steps: int = 30, seed: int = 11) -> Path:
    """A tiny llama trained for ``steps`` AdamW steps to say ``token`` after any context: a
    teacher whose distribution is far from a random student's and easy to learn (on-policy
    distillation tests). A few seconds on a CPU."""
    build_tiny_model(path, seed=seed)
    model = LlamaForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(1, len(VOCAB), (8, 24), generator=g)
        logits = model(input_ids=ids).logits  # (8, 24, V)
        target = torch.full((8 * 24,), VOCAB[token])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return path
