"""The engine protocol: what a sampler needs from whatever generates its tokens.

An engine sees token ids only (and a vision-language prompt's images). Chat templates and tokenization happen once, outside it
(``actors/data/chat.py``), and text is decoded where it is needed (scoring, recording), so the
token ids the learner trains on are exactly the ones generated, whatever the engine.

For every completion an engine returns the generated token ids, the behaviour log-prob of each
token (``log_softmax(logits / temperature)`` at the token, the quantity the learner recomputes),
the policy version of the weights that produced each token, a loss mask (1: the model's own
token; rollouts that splice in tool or environment tokens set 0 there), and why it ended.

Two kinds of engine share the protocol. A batch engine (``continuous = False``, the
transformers one) runs one call as one batch: the sampler hands it a whole batch of prompts at
once. A continuous engine (``continuous = True``, vLLM) interleaves the requests of concurrent
calls in its own batches: the sampler submits each prompt alone, as soon as it is admitted, and
a group leaves as soon as its own completions are done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from messages.rollout import SamplingParams

if TYPE_CHECKING:
    from actors.runtime.config import SamplerConfig
    from actors.runtime.transports.sources import WeightsSource


@dataclass(frozen=True)
class GenerateRequest:
    prompt_ids: list[int]
    """The tokens to continue (a chat-templated prompt, or a whole multi-turn context)."""
    params: SamplingParams
    """Temperature (0: greedy), top-p, top-k, the response budget and stop strings."""
    n: int = 1
    """Completions of this prompt."""
    seed: int | None = None
    """Sampling seed of the first completion (the i-th uses ``seed + i``), to regenerate a
    recorded sample (``Sample.seed``); None: the engine picks. Engines without per-sample
    seeds (hf) seed the whole batch's draws with its first request's."""
    images: tuple[bytes, ...] = ()
    """The prompt's images, encoded (a vision-language model's prompt): ``prompt_ids`` holds
    their image tokens already expanded (``actors/data/vision.py``)."""
    stream: Callable[[int, list[int], list[float]], None] | None = field(default=None,
                                                                         compare=False)
    """Called with each completion's index and its new token ids and log-probs as they are
    sampled, from the engine's own thread (the callee hands them to its loop). A continuous
    engine (vllm) calls it per engine step; a batch engine (hf) never does: its completions
    arrive whole."""


@dataclass
class Generation:
    """One completion: per-token tensors of the response's length ``R``."""

    token_ids: torch.Tensor  # (R,) int32
    logprobs: torch.Tensor  # (R,) float32, behaviour log-prob of each token at the temperature
    versions: torch.Tensor  # (R,) int32, policy version of the weights that produced each token
    loss_mask: torch.Tensor  # (R,) int8, 1 on the model's own tokens
    finish_reason: str  # "stop" (EOS or a stop string) or "length" (the budget ran out)
    version: int  # the oldest version it was generated with (that of its first token, or the
    # engine's version when it started, for an empty completion)
    seed: int = -1  # the sampling seed that regenerates it exactly (-1: not reproducible alone)


class Rejected(Exception):
    """The engine refuses a request for good (a prompt too long for the model's context):
    sending it again would fail again, so the prompt is dropped with this reason."""


class Engine(Protocol):
    """What a sampler needs of an engine. Every engine is checked against it by mypy where it is
    loaded (an engine row's ``load`` returns a ``start`` giving ``Engine``), so a signature that
    drifts fails the type check instead of a job. Its figures are properties: the engine sets
    them, the sampler reads."""

    @property
    def continuous(self) -> bool:
        """True: concurrent calls share the engine's batches (submit prompts one by one); False:
        one call is one batch (submit a whole batch at once)."""
        ...

    @property
    def version(self) -> int:
        """Policy version of the weights loaded now (-1 before the first ``load_weights``)."""
        ...

    @property
    def weight_sync_s(self) -> float:
        """Seconds generation has stood still for weight loads, all loads together."""
        ...

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[list[Generation]]:
        """The ``n`` completions of every request, in request order. Cancelling the call ends
        generation early; nothing is returned then. Raises ``Rejected`` for a request the
        engine will never accept."""
        ...

    async def load_weights(self, version: int, source: WeightsSource) -> None:
        """Make ``source`` (tensors named as the model's ``named_parameters``, a file of them, a
        transfer the engine's workers receive, or LoRA adapters) the weights of ``version``;
        tokens generated from then on carry it. An engine raises for a kind of source it
        cannot take."""
        ...

    async def watch(self) -> None:
        """Never return while the engine is healthy; raise once it has died (an engine process
        gone). The sampler runs it beside its work, so a dead engine is the sampler's failure
        even when no request is waiting on it."""
        ...

    async def aclose(self) -> None:
        """Release the engine (and any process it started)."""
        ...


@dataclass(frozen=True)
class AdapterLimits:
    """The LoRA adapters an engine applies (``learner.lora.rank > 0``), known at its start."""

    rank: int  # learner.lora.rank
    slots: int  # adapter versions held at once: algorithm.max_staleness + 2 (in flight + new)
    vision: bool = False  # learner.lora.vision: the vision tower's layers carry adapters too


@dataclass(frozen=True)
class EngineSpec:
    """What an engine's ``start`` is given."""

    model: Path  # the Hugging Face directory of the policy
    dtype: str  # torch dtype name the engine computes in
    seed: int  # this sampler's seed
    device: Any  # torch.device the engine runs on
    sampler: SamplerConfig  # the sampler's section (the engine's own section is a key of it)
    label: str = ""  # names the engine's processes (sampler name and run directory)
    transport: str = ""  # the weights transport ("": none; GPU ones configure its worker)
    adapters: AdapterLimits | None = None  # LoRA: the versions arrive as adapters of this
    memory: Any = None  # a MemoryLender: GPU memory a sleeping engine lends the learner
    profiles: Path | None = None  # where batches of sampler.profile_batches write their profile


def full_generation(token_ids: torch.Tensor, logprobs: torch.Tensor, version: int,
                    finish_reason: str) -> Generation:
    """A completion generated by one version of the weights, every token the model's own."""
    n = token_ids.shape[0]
    return Generation(token_ids.to(torch.int32), logprobs.float(),
                      torch.full((n,), version, dtype=torch.int32),
                      torch.ones(n, dtype=torch.int8), finish_reason, version)
