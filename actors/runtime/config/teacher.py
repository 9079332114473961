"""``[teacher]``: a served model pool for on-policy distillation (``actors/teacher/``).

Its workers sit behind the router in the pool ``teacher``, like reward workers; a sampler asks
one, after generating a group and beside scoring it, for the teacher's log-prob of every
sampled token, which travels with the sample (``Sample.teacher_logprobs``), is recorded with it
and becomes the learner's distillation advantage (``kernels/distill.py``). Without
``teacher.path`` the job has no teacher (no process, no request, no change to training).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from actors.runtime.config.constraints import (
    Device,
    ModelPath,
    NonNegFinite,
    NonNegFloat,
    NonNegInt,
    PositiveInt,
)
from actors.runtime.config.schema_base import Restart, _Section, need


class TeacherConfig(_Section, frozen=True):
    count_key: ClassVar[str] = "replicas"  # the key that sets ``count``, for errors naming it
    path: ModelPath = ""
    """Local Hugging Face directory of the teacher (a causal LM sharing the student's tokenizer:
    checked before the job starts), or ``default`` for the embedded model; empty: no teacher."""
    replicas: PositiveInt = 1
    """Teacher worker processes (the router balances requests over them by load)."""
    threads: PositiveInt = 1
    """torch intra-op threads of each teacher worker."""
    restart: Restart = "on-failure"
    """A teacher holds no state but its weights, so a failed worker restarts by default (the
    router re-sends what it held)."""
    max_restarts: NonNegInt = 3
    """Restarts allowed per teacher worker before the job is stopped."""
    host: str | list[str] = ""
    """With ``[hosts]``: the host of the teacher workers, or one host per replica."""
    device: Device = "auto"
    """auto (a GPU of its own when one is free, else shared with the others; cpu without GPUs),
    cpu, cuda, or cuda:N: the placement rules of the samplers (``config/layout.py``)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The teacher's dtype (auto: bfloat16 on a GPU, model.dtype on a CPU)."""
    capacity: PositiveInt = 4
    """Requests (groups) one worker takes at once; its forwards run one at a time."""
    batch_size: PositiveInt = 16
    """Sequences per teacher forward pass."""
    sleep_idle_s: NonNegFinite = 0.0
    """A worker idle this long gives its weights' memory back (to host memory on a GPU, read
    again from the checkpoint on a CPU: ``actors/scoring/sleep.py``, as model pools do) and
    wakes for the next request; 0: never sleeps."""
    weight: NonNegFloat = 1.0
    """Coefficient of the distillation advantage (slime ``opd_kl_coef``, verl
    ``distillation_loss_coef``): advantage += -weight * clamp(KL_t)."""
    task_rewards: bool = True
    """Add the distillation advantage to the task reward's (``algorithm.adv_estimator``); false:
    distillation alone, the task's rewards only recorded (verl ``use_task_rewards``)."""
    kl_kind: Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"] = "k1"
    """The per-token KL estimate of the advantage (verl ``loss_mode``; k1 = log π_student -
    log π_teacher, the sampled reverse KL of Thinking Machines' write-up)."""
    kl_clamp: NonNegFloat = 10.0
    """Per-token KL estimates are clamped to ±kl_clamp (verl ``loss_max_clamp``; 0: no clamp,
    slime's form)."""

    @property
    def count(self) -> int:
        """Processes of the kind ``teacher`` (the registry's loops read ``count``)."""
        return self.replicas if self.path else 0


def check_teacher(topology: Any) -> None:
    """The ``teacher`` keys; ``need(ok, key, why)`` raises a ``ConfigError`` naming the key."""
    from actors.runtime.config.placement import _cuda_problem

    T = topology.teacher
    if T.path and T.device.startswith("cuda"):
        ok, why = _cuda_problem(T.device)
        need(ok, "teacher.device", why)
    if not T.path:
        return
    need(T.weight > 0 or T.task_rewards, "teacher.weight",
         "is 0 and teacher.task_rewards is false: nothing would be trained on")
