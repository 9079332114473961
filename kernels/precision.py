"""The dtype the kernels compute in: float32 at least, float64 kept.

Log-probs may arrive in bfloat16 or float16 (a sampler's, or a mixed-precision forward); sums
and exponentials of them are done in float32. Float64 inputs stay float64, so a caller (or the
verl parity test) that wants the last digits gets them.
"""

from __future__ import annotations

import torch


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float64 if it is float64, else as float32 (ints and bools included)."""
    return x if x.dtype == torch.float64 else x.float()
