"""A tiny random Qwen2.5-VL (two text layers, hidden 64, one vision block) and its processor,
assembled here from a config and the character tokenizer (no hub), saved as a model directory.

The directory has what a real Qwen2.5-VL checkpoint has: ``config.json``, the weights, the
tokenizer with the vision tokens and a chat template that renders structured content (image
parts as ``<|vision_start|><|image_pad|><|vision_end|>``), and ``preprocessor_config.json``. Its
image processor keeps images small (at most 56x56 pixels: 4 patches of 14 merged 2x2 into one
image token per 28x28), so plumbing, parity and packing tests on it run in seconds.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from tests.tiny_model import CHARS, SPECIALS

VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB = {tok: i for i, tok in enumerate(SPECIALS + VISION_SPECIALS + CHARS)}
# Qwen2.5-VL's template, cut to what the tests use: text and image parts of string or list content
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vlm_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS + VISION_SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   bos_token=None, unk_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_vlm_config(hidden: int = 64, layers: int = 2) -> Qwen2_5_VLConfig:
    heads = 4
    half = hidden // heads // 2  # M-RoPE sections split the head's rotary half: t, h, w
    section = [half - 2 * (half // 3), half // 3, half // 3]
    text = dict(vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=0,
                eos_token_id=VOCAB["<|im_end|>"], bos_token_id=None, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": section})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=28,
                  fullatt_block_indexes=[0])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                            image_token_id=VOCAB["<|image_pad|>"],
                            video_token_id=VOCAB["<|video_pad|>"],
                            vision_start_token_id=VOCAB["<|vision_start|>"],
                            vision_end_token_id=VOCAB["<|vision_end|>"],
                            tie_word_embeddings=True)


def tiny_image_processor() -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's image processor (the PIL backend: no torchvision needed), small images."""
    return Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56,
                                    size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56})


def build_tiny_vlm(path: Path, *, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(tiny_vlm_config(hidden, layers))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tiny_vlm_tokenizer().save_pretrained(path)
    tiny_image_processor().save_pretrained(path)
    return path


def solid_png(rgb: tuple[int, int, int], size: int = 28) -> bytes:
    """A ``size`` x ``size`` PNG of one colour."""
    out = io.BytesIO()
    Image.new("RGB", (size, size), rgb).save(out, format="PNG")
    return out.getvalue()
