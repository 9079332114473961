"""Teacher flow: the bodies of ``teacher`` pool messages (``messages.routing`` carries them).

Sampler -> teacher worker: one ``TeacherRequest`` per group, with the prompt's token ids once
and each sample's response ids; teacher worker -> sampler: one ``TeacherReply`` with the
teacher's log-prob of every response token, per response, in order (on-policy distillation:
the learner's advantage is the per-token reverse KL to them). The router forwards both as
opaque bodies and never decodes them.
"""

from __future__ import annotations

import msgspec

from messages.tensor import Tensor


class TeacherRequest(msgspec.Struct, tag=True, gc=False):
    """Sampler -> teacher worker: the token ids of one group (the teacher reads ids, no text:
    teacher and student share the tokenizer, which the runner checks before starting)."""

    prompt_ids: Tensor  # (P,) int32, the chat-templated prompt tokens
    responses: list[Tensor]  # each (R_i,) int32, a sample's response tokens
    images: list[bytes] = []  # the prompt's encoded images (``Prompt.images``): ``prompt_ids``
    # holds their tokens expanded, and a vision-language teacher reads their pixels


class TeacherReply(msgspec.Struct, tag=True, gc=False, omit_defaults=True):
    """Teacher worker -> sampler: per response, in order, ``log π_teacher(token)`` of each of its
    tokens, (R_i,) float32 at temperature 1; or no log-probs and an ``error``."""

    logprobs: list[Tensor]
    error: str = ""  # non-empty: the teacher could not compute them (the group is dropped)


ToTeacherWorker = TeacherRequest
ToTeacherClient = TeacherReply
