"""The bound on scoring failures: a job whose scoring fails never trains on its zeros.

A sample whose scoring failed (``Sample.reward_error``: the user's function raised, returned a
bad value, hung past ``reward.timeout_s`` or crashed its child) scores 0.0. Before the replay
buffer serves a step's batch it counts such samples in it; when their share passes
``reward.max_error_share`` it does not serve the batch: it drops every group it holds that has
a failed sample (fate ``dropped``, reason ``score_errors``, so a resume after the fix never
serves them), drops any such group that still comes in, records, and asks the runner to stop
the job (``Abort``), naming the count and the first failing sample with its traceback. The
learner never took that step, so its final checkpoint is the last step trained; starting again
with the same ``run.dir`` resumes from it with the groups that scored cleanly. A validation
round is held to the same share.

Why per step, with 0.5 by default: a systematic bug (a missing key, a wrong signature that the
preflight could not see, an import that fails in the worker) fails every sample, so the first
step stops; a flaky function failing one item in 100 fails more than half of a step's samples
with vanishing probability (32 samples: ~1e-25), so it trains, with the failures counted
(``replay/score_errors`` per step) and shown in red on the live panel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from messages.rollout import ScoredGroup


@dataclass(frozen=True)
class ErrorCount:
    failed: int
    """Samples whose scoring failed."""
    samples: int
    """Samples counted."""
    first: str
    """The first failed sample: where it is, its error and its traceback ("" when none failed)."""

    @property
    def share(self) -> float:
        return self.failed / self.samples if self.samples else 0.0


def count_errors(groups: Iterable[ScoredGroup]) -> ErrorCount:
    """Failed samples among ``groups``' samples, and the first one's story."""
    failed = samples = 0
    first = ""
    for g in groups:
        for j, s in enumerate(g.samples):
            samples += 1
            if s.reward_error:
                failed += 1
                if not first:
                    first = (f"group {g.prompt.prompt_id} (data_source {g.prompt.data_source}) "
                             f"sample {j}: {s.reward_error}"
                             + (f"\n{s.reward_trace.rstrip()}" if s.reward_trace else ""))
    return ErrorCount(failed, samples, first)


def over_bound(count: ErrorCount, max_share: float) -> bool:
    return count.failed > 0 and count.share > max_share


def stop_reason(count: ErrorCount, what: str, max_share: float) -> str:
    """The message that stops the job: its first line is the outcome."""
    return (f"scoring failed on {count.failed} of {count.samples} samples "
            f"({100 * count.share:.0f}%) of {what}, over reward.max_error_share = {max_share:g}"
            f"\nfirst failure: {count.first}")

