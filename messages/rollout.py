"""Rollout flow: prompts out of the replay buffer, scored groups back into it, batches to the learner.

Sockets: the replay buffer binds one ROUTER (``replay`` address). Samplers and the learner
connect DEALERs and send ``ToReplay`` messages; the replay buffer answers with ``FromReplay``.
A request the buffer cannot serve yet (admission closed, batch not full) is held, not refused:
that waiting is the backpressure of the whole system.
"""

from __future__ import annotations

import msgspec

from messages.tensor import Tensor


class ChatMessage(msgspec.Struct, array_like=True, gc=False, frozen=True):
    role: str
    content: str


class Prompt(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One dataset row as issued to a sampler (verl row layout, flattened)."""

    prompt_id: int  # unique over the run: every issued prompt is counted exactly once
    messages: list[ChatMessage]
    data_source: str
    ground_truth: str
    extra_info: dict[str, str | int | float] = {}
    images: list[bytes] = []  # encoded images (PNG, JPEG, ...), one per ``<image>`` placeholder
    # in the messages' text, in order; they travel once, to the sampler: the group it sends
    # back names its prompt by ``prompt_id`` and leaves them out (the replay buffer holds them)


class SamplingParams(msgspec.Struct, array_like=True, gc=False, frozen=True, omit_defaults=True):
    """How a group was generated; the learner recomputes log-probs at this temperature."""

    temperature: float = 1.0  # 0: greedy (remax's baseline sample)
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k truncation
    max_tokens: int = 32  # response budget: every token after the prompt counts
    stop: tuple[str, ...] = ()  # stop strings besides EOS


class Turn(msgspec.Struct, array_like=True, gc=False, frozen=True, omit_defaults=True):
    """One span of a multi-turn response: tokens ``[start, end)`` of ``Sample.response_ids``.

    An ``assistant`` span is the model's own tokens (loss mask 1); a ``tool`` span is the
    rendered result of one tool call and a ``user`` span an environment's observation (loss mask
    0 on both, template tokens around the result included). Spans tile the response in order;
    an environment's last observation (the episode is done) and a failed reset are ``user``
    spans with no tokens (``start == end``): recorded, never shown to the model.
    """

    role: str  # "assistant", "tool" or "user"
    start: int
    end: int
    content: str = ""  # assistant: the decoded tokens; tool / user: the text the tool or the
    # environment returned (after the middle cut), as it was rendered into the span's tokens
    name: str = ""  # tool: the tool called ("" when the call named none that parses)
    arguments: str = ""  # tool: the call's arguments as JSON (the raw call text if unparsable)
    error: str = ""  # tool / user: non-empty when the call or step failed (the model read it)
    failure: str = ""  # the kind of failure: parse, unknown_tool, arguments, raised, timeout,
    # crash (empty when it succeeded)
    latency_s: float = 0.0  # tool / user: seconds the call or step took
    reward: float | None = None  # assistant: the environment's reward for this turn's action
    request: str = ""  # assistant, endpoint rollouts: the body of the call that produced this
    # turn, as the agent sent it (JSON)
    response: str = ""  # assistant, endpoint rollouts: the answer's body the agent read (JSON;
    # streamed answers: the body their events were cut from)


class Sample(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One completion of a prompt with everything the learner needs to train on it.

    Per-token fields all have the response's length ``R``. Fields are only ever appended, with
    defaults, so recordings made before a field existed still decode.
    """

    response_ids: Tensor  # (R,) int32, response tokens only
    behaviour_logprobs: Tensor  # (R,) float32, log π_behaviour(token) at the sampling temperature
    policy_version: int  # version of the oldest token's weights (actors/runtime/versions.py)
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    reward: float = 0.0
    reward_error: str = ""  # non-empty when scoring failed; the reward is then 0.0
    token_versions: Tensor | None = None  # (R,) int32 version of each token's weights
    # (None in recordings made before tokens carried their own: every token is policy_version)
    loss_mask: Tensor | None = None  # (R,) int8, 1 on the model's own tokens, 0 on tool or
    # environment tokens (None in older recordings: all 1)
    reward_extra: dict[str, float] = {}  # the scorer's numeric extras (``ScoreResult.extra``:
    # a compute_score dict's other keys, each function's score); gdpo's reward components
    turns: list[Turn] = []  # a multi-turn response's spans in order (empty: one model turn)
    seed: int = -1  # the engine's sampling seed of this completion: the same prompt, sampling
    # parameters, weights and seed regenerate it exactly (-1: the engine has no per-sample seed)
    answer: str = ""  # the answer the scorer extracted from ``text`` ("" when it extracts none)
    reward_trace: str = ""  # with reward_error, when a user's function raised: its traceback
    # (the user code's frames), which the message that stops a job whose scoring fails shows
    teacher_logprobs: Tensor | None = None  # (R,) float32, log π_teacher(token) of each response
    # token at temperature 1, when the job has a ``[teacher]`` (on-policy distillation); None
    # otherwise
    reward_of: int = -1  # an endpoint episode's earlier segment (it branched): the index in the
    # group of the episode's last sample, whose reward it shares (-1: its own reward)
    prompt_ids: Tensor | None = None  # (P',) int32, the sample's own prompt when it is not the
    # group's (an endpoint call that rendered another conversation); None: the group's
    images: list[bytes] = []  # encoded images of its own prompt (``prompt_ids`` holds their
    # tokens expanded), an endpoint call's ``image_url`` parts; with ``prompt_ids`` None: the
    # group's prompt's (``Prompt.images``)


class ScoredGroup(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Sampler -> Replay: the ``n`` scored samples of one prompt (more when an endpoint
    episode branched: ``Sample.reward_of``)."""

    prompt: Prompt
    prompt_ids: Tensor  # (P,) int32, the chat-templated prompt tokens
    samples: list[Sample]
    sampler: str
    generate_seconds: float = 0.0
    score_seconds: float = 0.0
    baseline_reward: float | None = None  # remax: reward of a greedy sample of the same prompt
    sampling: SamplingParams | None = None  # how it was generated (None in older recordings)
    score_error: str = ""  # non-empty: the group could not be scored (no reward worker answered
    # in time); the replay buffer records it and drops it, it is never trained on
    generate_error: str = ""  # non-empty: the engine refused the prompt for good (too long for
    # the context); the group has no samples and the replay buffer drops it as ``rejected``
    weight_sync_s: float = 0.0  # seconds the sampler's engine spent swapping weights since the
    # previous group this sampler sent (each swap counted in exactly one group)
    teacher_seconds: float = 0.0  # seconds the teacher took to answer this group (0: no teacher)


class PromptRequest(msgspec.Struct, tag=True, gc=False):
    """Sampler -> Replay: ask for up to ``max_prompts`` prompts (answered when admission allows).

    ``incarnation`` identifies the sampler process; when it changes under the same name (a
    restart), the prompts the old process held are issued again, so none is lost.
    """

    max_prompts: int
    incarnation: str = ""


class SamplerAlive(msgspec.Struct, tag=True, gc=False):
    """Sampler -> Replay, every ``run.heartbeat_interval``: it is alive and holds its prompts
    (one silent past ``replay.sampler_timeout_s`` has its prompts issued to the others)."""

    incarnation: str = ""


class SamplerLeaving(msgspec.Struct, tag=True, gc=False):
    """Sampler -> Replay, its last message (detach, or its machine going away): every prompt the
    buffer issued to it and got no group for is issued again to the others (the buffer's own
    record decides; ``unfinished`` is what the sampler knows it hands back, for the log).
    Answered with ``LeaveAck``."""

    incarnation: str = ""
    unfinished: list[int] = []  # prompt ids it held without a group sent


class GroupsDone(msgspec.Struct, tag=True, gc=False):
    """Sampler -> Replay: scored groups for prompts this sampler was issued."""

    groups: list[ScoredGroup]


class ValidationDone(msgspec.Struct, tag=True, gc=False):
    """Sampler -> Replay: scored groups of validation prompts of the round of ``step`` (counted
    apart from training prompts; never trained on)."""

    step: int
    groups: list[ScoredGroup]


class BatchRequest(msgspec.Struct, tag=True, gc=False):
    """Learner -> Replay: ask for the batch of ``step``; ``version`` is the learner's policy version.

    The version is what admission control and the staleness filter measure against.
    """

    step: int
    version: int
    num_groups: int


class VersionUpdate(msgspec.Struct, tag=True, gc=False):
    """Learner -> Replay: a new policy version was published (opens admission)."""

    version: int


class PromptBatch(msgspec.Struct, tag=True, gc=False):
    """Replay -> Sampler: prompts to generate for (possibly fewer than asked).

    ``version`` is the learner's policy version when they were issued; its weights were
    published before the replay buffer learned of it, so the sampler waits for them (they are
    already on the wire) rather than generating with older ones that would go stale.

    ``validation``: these are prompts of the validation of the policy of ``version``, to be
    generated with ``sampling`` and ``n`` (not the sampler's own) and with those weights (none
    newer, while they are the newest it holds), and handed back as ``ValidationDone``.
    """

    prompts: list[Prompt]
    version: int = 0
    validation: bool = False
    sampling: SamplingParams | None = None  # validation: how to sample
    n: int = 0  # validation: samples per prompt
    # run.deterministic: the seed of this generation batch's draws, fixed by its place in the
    # run (-1: the engine's own sequence)
    seed: int = -1


class PublishRequest(msgspec.Struct, tag=True, gc=False):
    """Learner -> Replay (``run.deterministic``): may ``version`` go out? Answered with
    ``PublishReady`` once every group the schedule generates with an older version is back and
    on disk, so no group is ever generated with weights newer than its place gives it."""

    version: int


class PublishReady(msgspec.Struct, tag=True, gc=False):
    """Replay -> Learner: ``version`` may be published (the answer to ``PublishRequest``)."""

    version: int


class LeaveAck(msgspec.Struct, tag=True, gc=False):
    """Replay -> Sampler: its ``SamplerLeaving`` is through; ``requeued`` prompts it held are
    issued again (its groups sent before are accepted, nothing it sends later is)."""

    requeued: int


class TrainBatch(msgspec.Struct, tag=True, gc=False):
    """Replay -> Learner: the groups of one training step and the buffer's counters at that moment."""

    step: int
    groups: list[ScoredGroup]
    counters: dict[str, int] = {}
    # this batch's figures (groups filtered since the last batch, the groups' age in versions
    # and serves); the learner logs them, like the counters, as replay/* metrics
    stats: dict[str, float] = {}


ToReplay = (PromptRequest | GroupsDone | BatchRequest | VersionUpdate | ValidationDone
            | SamplerAlive | SamplerLeaving | PublishRequest)
FromReplay = PromptBatch | TrainBatch | LeaveAck | PublishReady
