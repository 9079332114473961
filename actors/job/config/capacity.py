"""Checks at start of what a machine holds, from the model's files (torch-free, in the runner).

``check_shm``: with the shared-memory weights transport the learner keeps each published
version as a file in ``/dev/shm`` (its row's ``shm_versions``: the newest ``SHM_KEEP = 2`` plus
the one being written). A ``/dev/shm`` too small for that (Docker's default is 64 MB) would
crash the learner at its first publish; it is a config error at start instead, naming
``learner.weights_transport``. A version's bytes are the model's parameter count (read from its
safetensors headers, or estimated from config.json) times the size of the dtype it is sent in;
with LoRA, the adapters' parameter count (a version is the adapters alone).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path

from actors.data.vision import in_vision_tower
from actors.model_shape import head_width, layer_weights
from actors.runtime.config import ConfigError, auto_dtype, samplers_dtype
from actors.runtime.transports.table import TRANSPORTS
from messages.tensor import ITEMSIZE

SHM_DIR = Path("/dev/shm")


def parameter_count(model_dir: Path) -> int:
    """Parameters of the model in ``model_dir``: summed from its safetensors headers (exact),
    or estimated from config.json (a decoder-only transformer) when it has none."""
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return sum(math.prod(shape) for _, shape in _tensor_shapes(files))
    c = json.loads((model_dir / "config.json").read_text())
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    inter = c.get("intermediate_size", 4 * h)
    heads = c.get("num_attention_heads", 1)
    kv = c.get("num_key_value_heads", heads)
    head_dim = head_width(h, heads, c.get("head_dim"))
    per_layer = layer_weights(h, inter, heads, kv, head_dim) + 2 * h  # and its two norms
    embed = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2)
    return layers * per_layer + embed + h


def matrix_shapes(model_dir: Path) -> dict[str, tuple[int, int]] | None:
    """The 2-D ``weight`` of every module of the model in ``model_dir``, by module name
    (``model.layers.0.self_attn.q_proj``: (out, in)), from its safetensors headers; None
    without them."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    return {name.removesuffix(".weight"): (shape[0], shape[1])
            for name, shape in _tensor_shapes(files)
            if name.endswith(".weight") and len(shape) == 2}


def _tensor_shapes(files: list[Path]) -> Iterator[tuple[str, list[int]]]:
    """(name, shape) of every tensor the safetensors ``files`` hold, read from their headers
    alone (8 bytes of header length, then the JSON header)."""
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict):
                yield name, list(info.get("shape", []))


def linear_modules(model_dir: Path) -> set[str] | None:
    """The last name part of every module with a 2-D ``weight`` (``q_proj``, ``lm_head``,
    ``embed_tokens``...: what LoRA ``target_modules`` can name); None when not readable."""
    shapes = matrix_shapes(model_dir)
    if shapes is None:
        return None
    names = {n.rsplit(".", 1)[-1] for n in shapes}
    config = model_dir / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("tie_word_embeddings"):
        names.add("lm_head")  # tied: a module of the model, not a tensor of its files
    return names


def adapter_count(model_dir: Path, rank: int, targets: tuple[str, ...],
                  vision: bool = False) -> int | None:
    """Parameters of LoRA adapters of ``rank`` on the ``targets`` modules (A: rank x in, B:
    out x rank), what a LoRA version publishes; None when the shapes are not readable. A vision
    tower's matrices count with ``vision`` alone (``actors/learner/vision.py: lora_targets``)."""
    shapes = matrix_shapes(model_dir)
    if shapes is None:
        return None
    return sum(rank * (o + i) for n, (o, i) in shapes.items()
               if (vision if in_vision_tower(n) else n.rsplit(".", 1)[-1] in targets))


def sent_dtype(topology, learner_on_gpu: bool) -> str:
    """The dtype weights are published in (``learner.weights_dtype``; auto: the compute dtype,
    with LoRA the samplers' dtype)."""
    L = topology.learner
    if L.weights_dtype != "auto":
        return L.weights_dtype
    if L.lora.rank > 0:
        return samplers_dtype(topology, gpu_visible=learner_on_gpu)
    return auto_dtype(L.dtype, learner_on_gpu, topology.model.dtype)


def check_shm(topology, learner_on_gpu: bool = False, shm_dir: Path = SHM_DIR,
              shm_bytes: int | None = None) -> None:
    """ConfigError naming ``learner.weights_transport`` when the shared-memory transport is
    used and ``shm_dir`` (its size: ``shm_bytes``, default its filesystem's) cannot hold
    the versions of the weights it holds at once."""
    L = topology.learner
    versions = TRANSPORTS[L.weights_transport].shm_versions
    if not versions or L.node_rank > 0:
        return
    if shm_bytes is None:
        if not shm_dir.is_dir():
            return  # weights.py falls back to the temp folder, on disk
        st = os.statvfs(shm_dir)
        shm_bytes = st.f_frsize * st.f_blocks
    dtype = sent_dtype(topology, learner_on_gpu)
    model = Path(topology.model.path)
    count = adapter_count(model, L.lora.rank, L.lora.target_modules, L.lora.vision) \
        if L.lora.rank else None
    version = (count or parameter_count(model)) * ITEMSIZE[dtype]  # LoRA: the adapters
    need = versions * version
    if shm_bytes < need:
        raise ConfigError(
            f"learner.weights_transport: the shared-memory transport keeps up to "
            f"{versions} versions of the weights in {shm_dir} ({version / 2**20:.0f} MiB "
            f"each in {dtype}: {need / 2**20:.0f} MiB), but it holds {shm_bytes / 2**20:.0f} "
            f"MiB: set learner.weights_transport = \"zmq\", or give the machine a larger "
            f"{shm_dir} (docker run --shm-size=...)")
