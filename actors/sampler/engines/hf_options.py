"""The transformers engine's section, ``[sampler.hf]``. Needs neither torch nor transformers:
the config reads it."""

from __future__ import annotations

from typing import Literal

import msgspec

Decode = Literal["eager", "inductor", "cudagraphs"]


class HFOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    decode: Decode = "eager"
    """How generate decodes (sampler.engine = hf): eager (a growing KV cache, each prompt's
    cache computed once for its n samples), or a static KV cache whose decode step is compiled
    by torch.compile once per batch shape and replayed as CUDA graphs: inductor (fused kernels,
    the longer compile) or cudagraphs (the eager kernels captured, a shorter compile). The
    compiled modes pad prompts to a multiple of 64 tokens so a job's batches share a few shapes;
    transformers compiles on a GPU only, so on a CPU they decode eagerly over the static
    cache."""
