"""``runner.py export RUN_DIR --step N [--merge] [--out DIR]``: a checkpoint as a model to ship.

A full fine-tuning checkpoint is a Hugging Face model already: it is copied (without the
optimizer state). A LoRA checkpoint is a PEFT adapter (``adapter_config.json`` naming the base
model, ``adapter_model.safetensors``): copied as it is, or with ``--merge`` applied to its base
and written as one merged Hugging Face model (``merge_and_unload``), what ``from_pretrained``
and any server load without PEFT. The output is written to a temp folder and renamed.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import TextIO

from actors.offline.recorded import OfflineError
from actors.runtime.rundir import PARTIAL_PREFIX, checkpoint_dir

ADAPTER_CONFIG = "adapter_config.json"
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja")  # no optimizer state


def is_adapter(ckpt: Path) -> bool:
    """Whether ``ckpt`` holds a LoRA adapter (PEFT's format) rather than a whole model."""
    return (ckpt / ADAPTER_CONFIG).is_file()


def merge_adapter(ckpt: Path, out: Path, dtype: str = "float32") -> Path:
    """The adapter in ``ckpt`` merged into its base (``base_model_name_or_path`` of its config),
    written to ``out`` as a Hugging Face model with the checkpoint's tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_path = json.loads((ckpt / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base_path or not Path(base_path).is_dir():
        raise OfflineError(f"{ckpt / ADAPTER_CONFIG}: its base model {base_path!r} is not here")
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=getattr(torch, dtype))
    merged = PeftModel.from_pretrained(base, ckpt).merge_and_unload()
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(ckpt if (ckpt / "tokenizer_config.json").is_file()
                                  else base_path).save_pretrained(out)
    return out


def export(run_dir: str | Path, step: int, *, merge: bool = False, out_dir: str | None = None,
           dtype: str = "float32", out: TextIO = sys.stdout) -> int:
    run_dir = Path(run_dir)
    ckpt = checkpoint_dir(run_dir, step)
    if not ckpt.is_dir():
        kept = sorted(p.name for p in ckpt.parent.glob("step_*")) if ckpt.parent.is_dir() else []
        raise OfflineError(f"no checkpoint {ckpt} (kept: {', '.join(kept) or 'none'})")
    target = Path(out_dir) if out_dir else \
        run_dir / "export" / f"step_{step}{'-merged' if merge and is_adapter(ckpt) else ''}"
    if target.exists():
        raise OfflineError(f"{target} exists already: remove it or pass --out")
    tmp = target.parent / f"{PARTIAL_PREFIX}{target.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if merge and is_adapter(ckpt):
        merge_adapter(ckpt, tmp, dtype)
        what = "the LoRA adapter merged into its base: a Hugging Face model"
    else:
        for pattern in MODEL_FILES:
            for f in ckpt.glob(pattern):
                shutil.copy2(f, tmp / f.name)
        what = ("the LoRA adapter (PEFT format; --merge writes a merged model)" if is_adapter(ckpt)
                else "the model (full fine-tuning: nothing to merge)")
    tmp.rename(target)
    print(f"exported {ckpt.name} of {run_dir}: {what} -> {target}", file=out)
    return 0
