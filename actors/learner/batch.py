"""A training batch as padded tensors: scored groups in, next-token-aligned tensors out.

Rows are samples, ordered group by group (``group_sizes[g]`` consecutive rows for group ``g``:
``n`` each, more for a group with an endpoint episode that branched), each
``prompt + response`` right-padded to the batch width ``W``. Token-level tensors have ``W − 1``
columns aligned with next-token prediction: column ``t`` scores token ``t + 1``, so
``response_mask[i, t] = 1`` exactly where token ``t + 1`` of row ``i`` is a response token the model
generated itself (a sample's ``loss_mask`` zeroes tool and environment tokens there, so every
loss, aggregation, KL term, entropy and correction statistic leaves them out). The scalar
reward sits on the last token the model generated itself: a multi-turn response may end with
tool tokens (its budget ran out in a tool's answer), and a reward there would count for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from actors.data.vision import ImageProcessor
from actors.data.vision_inputs import VisionRows
from actors.learner.vision import row_images, vision_rows
from actors.runtime.tensors import from_wire
from messages.rollout import ScoredGroup


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # (N, W) long
    attention_mask: torch.Tensor  # (N, W) long
    response_mask: torch.Tensor  # (N, W-1) float, 1 on the model's own response tokens
    behaviour_logprobs: torch.Tensor  # (N, W-1) float, 0 outside the response
    token_rewards: torch.Tensor  # (N, W-1) float, the score on the last response token
    scores: torch.Tensor  # (N,) float
    versions: torch.Tensor  # (N,) long, policy version of each sample's oldest token
    truncated: torch.Tensor  # (N,) bool, response hit max_tokens
    baseline_rewards: torch.Tensor | None  # (N,) remax: reward of the group's greedy sample
    group_sizes: list[int]  # rows of each group, in order (sum = N)
    token_versions: torch.Tensor | None = None  # (N, W-1) long, each response token's policy
    # version (the sample's version outside the response)
    packed: bool = False  # the model reads these rows packed into one (actors/learner/packing.py)
    teacher_logprobs: torch.Tensor | None = None  # (N, W-1) float, the teacher's log-prob of each
    # response token (on-policy distillation), 0 outside the response; None when a sample lacks them
    vision: VisionRows | None = None  # the rows' images (vision-language models), None: text only
    lengths: tuple[int, ...] = ()  # each row's tokens, on the host: a micro-batch's width
    # without reading the device (a host sync per micro-batch on a GPU); (): read it there
    shared: tuple[int, ...] = ()  # the leading tokens each row has in common with the row
    # before it in its group (0: the group's first row), on the host: a packed micro-batch
    # computes each group's common prefix once (actors/learner/packing.py); (): none shared

    @property
    def group_size(self) -> int | list[int]:
        """Rows per group: one int when every group has as many, else one count per group."""
        return self.group_sizes[0] if len(set(self.group_sizes)) == 1 else self.group_sizes

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> RolloutBatch:
        """The same batch with every tensor on ``device``."""
        moved: dict[str, Any] = {f.name: (v.to(device) if isinstance(
            v := getattr(self, f.name), torch.Tensor | VisionRows) else v) for f in fields(self)}
        return RolloutBatch(**moved)

    def rows(self, index: slice) -> RolloutBatch:
        """Rows ``index`` with the width trimmed to their longest sequence."""
        width = (max(self.lengths[index]) if self.lengths
                 else int(self.attention_mask[index].sum(1).max()))
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                cols = width if value.shape[1] == self.input_ids.shape[1] else width - 1
                value = value[index, :cols]
            elif isinstance(value, torch.Tensor):
                value = value[index]
            elif isinstance(value, VisionRows):
                value = value.rows(index)
            elif f.name == "lengths":
                value = value[index]
            elif f.name == "shared" and value:  # the first row starts a group of these rows
                value = (0, *value[index][1:])
            elif f.name == "group_sizes":  # the groups these rows cut (in part, at the ends)
                value = [hi - lo for lo, hi in _spans(self.group_sizes, index)]
            out[f.name] = value
        return RolloutBatch(**out)


def _spans(sizes: list[int], index: slice) -> list[tuple[int, int]]:
    start, stop, _ = index.indices(sum(sizes))
    out, lo = [], 0
    for n in sizes:
        a, b = max(lo, start), min(lo + n, stop)
        if a < b:
            out.append((a, b))
        lo += n
    return out


def build_batch(groups: list[ScoredGroup], pad_id: int,
                processor: ImageProcessor | None = None) -> RolloutBatch:
    """The padded batch of ``groups``; ``processor``: the model's, which turns the
    prompts' images into the vision tower's pixel tensors (vision-language models)."""
    if any(not g.samples for g in groups):
        raise ValueError("every group of a batch must have a sample")
    rows = []
    for g in groups:
        group_prompt = from_wire(g.prompt_ids).long()
        for s in g.samples:  # a sample may follow a prompt of its own (endpoint branches)
            prompt = group_prompt if s.prompt_ids is None else from_wire(s.prompt_ids).long()
            rows.append((prompt, from_wire(s.response_ids).long(),
                         from_wire(s.behaviour_logprobs).float(), s, g.baseline_reward))
    width = max(len(p) + len(r) for p, r, *_ in rows)
    N = len(rows)
    ids = torch.full((N, width), pad_id, dtype=torch.long)
    attn = torch.zeros((N, width), dtype=torch.long)
    mask = torch.zeros((N, width - 1))
    behav = torch.zeros((N, width - 1))
    rewards = torch.zeros((N, width - 1))
    token_versions = torch.zeros((N, width - 1), dtype=torch.long)
    has_teacher = all(s.teacher_logprobs is not None for *_, s, _ in rows)
    teacher = torch.zeros((N, width - 1)) if has_teacher else None
    for i, (p, r, lp, s, _) in enumerate(rows):
        end = len(p) + len(r)
        token_versions[i] = s.policy_version
        if s.token_versions is not None:
            token_versions[i, len(p) - 1 : end - 1] = from_wire(s.token_versions).long()
        ids[i, :end] = torch.cat([p, r])
        attn[i, :end] = 1
        own = torch.ones(len(r)) if s.loss_mask is None else from_wire(s.loss_mask).float()
        mask[i, len(p) - 1 : end - 1] = own
        behav[i, len(p) - 1 : end - 1] = lp
        if teacher is not None and s.teacher_logprobs is not None:  # all or none (has_teacher)
            teacher[i, len(p) - 1 : end - 1] = from_wire(s.teacher_logprobs).float()
        at = own.nonzero()
        if len(at):  # the last token the model generated itself (tool tokens may follow it)
            rewards[i, len(p) - 1 + int(at[-1])] = s.reward
    vision = vision_rows(groups, processor)
    baselines = None
    if any(b is not None for *_, b in rows):
        baselines = torch.tensor([b if b is not None else 0.0 for *_, b in rows])
    return RolloutBatch(
        input_ids=ids, attention_mask=attn, response_mask=mask, behaviour_logprobs=behav,
        token_rewards=rewards, scores=torch.tensor([s.reward for *_, s, _ in rows]),
        versions=torch.tensor([s.policy_version for *_, s, _ in rows]),
        truncated=torch.tensor([s.finish_reason == "length" for *_, s, _ in rows]),
        baseline_rewards=baselines, group_sizes=[len(g.samples) for g in groups],
        token_versions=token_versions, teacher_logprobs=teacher,
        vision=vision,
        lengths=tuple(len(p) + len(r) for p, r, *_ in rows),
        shared=common_prefixes([torch.cat([p, r]) for p, r, *_ in rows],
                               [len(g.samples) for g in groups],
                               [row_images(g, s) for g in groups for s in g.samples]
                               if vision else None),
    )


def common_prefixes(sequences: list[torch.Tensor], group_sizes: list[int],
                    images: list | None = None) -> tuple[int, ...]:
    """For each row, the leading tokens it has in common with the row before it when both are
    of one group (0 for a group's first row), at most all but one token of either. ``images``:
    each row's prompt images, where a row's image tokens take their features: rows whose
    images differ share nothing (their image tokens may be alike, their pixels are not)."""
    out = []
    row = 0
    for size in group_sizes:
        for j in range(size):
            a, b = sequences[row - 1] if j else None, sequences[row]
            common = 0
            if a is not None and (images is None or images[row - 1] == images[row]):
                n = min(len(a), len(b)) - 1
                differ = (a[:n] != b[:n]).nonzero()
                common = int(differ[0]) if len(differ) else max(n, 0)
            out.append(common)
            row += 1
    return tuple(out)


def reward_components(groups: list[ScoredGroup], keys: list[str]) -> torch.Tensor:
    """gdpo's reward components (K, N), rows in batch order: ``Sample.reward_extra[key]`` for
    each of the K keys (verl ``algorithm.gdpo_reward_keys``). A sample whose scoring failed
    scores 0 on every component, as on its reward; any other sample must carry every key."""
    out = torch.zeros(len(keys), sum(len(g.samples) for g in groups))
    row = 0
    for g in groups:
        for j, s in enumerate(g.samples):
            for k, key in enumerate(keys):
                if key in s.reward_extra:
                    out[k, row] = s.reward_extra[key]
                elif not s.reward_error:
                    raise ValueError(
                        f"gdpo reward key {key!r} is not in the scorer's result of prompt "
                        f"{g.prompt.prompt_id} sample {j} (its keys: {sorted(s.reward_extra)}); "
                        "algorithm.gdpo_reward_keys must name keys that every compute_score "
                        "result holds")
            row += 1
    return out
