"""torch tensors to and from the wire format (dtype, shape, bytes)."""

from __future__ import annotations

import warnings

import torch

from messages.tensor import Tensor, TensorMeta, nbytes

_TORCH = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
_NAME = {v: k for k, v in _TORCH.items()}


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def to_wire(t: torch.Tensor) -> Tensor:
    return Tensor(dtype=_NAME[t.dtype], shape=tuple(t.shape), data=bytes(raw_bytes(t)))


def meta(name: str, t: torch.Tensor) -> TensorMeta:
    return TensorMeta(name=name, dtype=_NAME[t.dtype], shape=tuple(t.shape))


def from_buffer(dtype: str, shape: tuple[int, ...], data) -> torch.Tensor:
    """A tensor over ``data`` (bytes, memoryview or zmq frame buffer); validates the size."""
    if dtype not in _TORCH:
        raise ValueError(f"unknown tensor dtype {dtype!r}")
    if any(d < 0 for d in shape):  # torch would raise RuntimeError, which callers do not expect
        raise ValueError(f"negative tensor dimension in shape {tuple(shape)}")
    buf = memoryview(data).cast("B")
    need = nbytes(dtype, tuple(shape))
    if buf.nbytes != need:
        raise ValueError(f"tensor {dtype}{list(shape)} needs {need} bytes, got {buf.nbytes}")
    if 0 in shape:
        return torch.empty(shape, dtype=_TORCH[dtype])
    with warnings.catch_warnings():  # received frames are read-only; callers copy, never write
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(_TORCH[dtype]).view(shape)


def from_wire(t: Tensor) -> torch.Tensor:
    return from_buffer(t.dtype, t.shape, t.data)
