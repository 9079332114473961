"""The sampler's request to the teacher pool (on-policy distillation): a group's token ids out,
the teacher's log-prob of every response token back, through the router like scoring (the same
``ScoringClient``: its timeout and re-sends; the router re-sends the request of a teacher worker
that dies or goes silent)."""

from __future__ import annotations

import torch

from actors.runtime.tensors import to_wire
from actors.sampler.scoring_client import ScoringClient
from messages.codec import Codec, DecodeError, encode
from messages.teacher import TeacherRequest, ToTeacherClient
from messages.tensor import Tensor

POOL = "teacher"
_codec: Codec[ToTeacherClient] = Codec(ToTeacherClient)


async def teacher_logprobs(client: ScoringClient, prompt_ids: list[int],
                           responses: list[torch.Tensor], images: list[bytes] | None = None
                           ) -> tuple[list[Tensor] | None, str]:
    """Per response, the teacher's ``(R_i,)`` float32 log-probs of its tokens (given the
    prompt's ``images``); or None and why."""
    request = TeacherRequest(to_wire(torch.tensor(prompt_ids, dtype=torch.int32)),
                             [to_wire(r.to(torch.int32)) for r in responses], list(images or []))
    body = await client.request(POOL, encode(request))
    if body is None:
        return None, (f"no teacher worker answered after {client.attempts} sends "
                      f"{client.timeout_s:g} s apart")
    try:
        reply = _codec.decode(body)
    except DecodeError as exc:
        return None, f"undecodable teacher reply: {exc}"[:300]
    if reply.error:
        return None, reply.error
    lengths = [len(r) for r in responses]
    got = [t.shape[0] if len(t.shape) == 1 else -1 for t in reply.logprobs]
    if got != lengths or any(t.dtype != "float32" for t in reply.logprobs):
        return None, f"teacher reply of {got} float32 log-probs for responses of {lengths} tokens"
    return reply.logprobs, ""
