"""Tensors on the wire: dtype name, shape and raw bytes (never Python lists).

Small tensors (token ids, log-probs of one sample) ride inside a message as a ``Tensor``
struct. Large ones (model weights) travel as their own zero-copy ZeroMQ frames, described by
``TensorMeta`` in the message header.
"""

from __future__ import annotations

import msgspec

# dtype names as numpy / torch spell them; the receiver rejects anything else
DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
ITEMSIZE = {
    "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape``: the one rule every sender and receiver
    sizes buffers by (KeyError for a dtype not in ``DTYPES``)."""
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    return n


class TensorMeta(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Name, dtype and shape of a tensor whose bytes follow in a separate frame."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


class Tensor(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A tensor carried inside a message: ``len(data) == prod(shape) * itemsize(dtype)``."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def validate(self) -> None:
        """Raise ValueError if the dtype is unknown or the byte count does not match the shape."""
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"unknown tensor dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative tensor dimension in shape {self.shape}")
        expected = nbytes(self.dtype, self.shape)
        if len(self.data) != expected:
            raise ValueError(
                f"tensor of dtype {self.dtype} and shape {self.shape} needs {expected} bytes, "
                f"got {len(self.data)}"
            )
