"""The advantage estimators and policy losses whose traits change what the actors do train in a
whole job (the tiny model, three steps): an estimator whose inputs come from the sampler
(remax's greedy completion) or the reward worker (gdpo's reward keys), one with a critic to
train and checkpoint (gae), one that needs π_old's forward before the advantages (the optimal
token baselines), a loss that corrects π_θ against μ itself (bypass mode). Each is exercised by
the actors that make its inputs, not by the learner alone. A variant that differs only in its
function is the learner's alone: tests/test_learner.py takes a step of every one through the
same trainer a job runs, on made-up groups, and a job would add nothing but its minutes.

The names come from the config's rows; a row whose options all have defaults needs no case (it
runs by its name alone), one that needs an option without a case fails
``test_every_variant_has_a_case_that_decodes``. Behind ``-m slow`` (run by CI): one job per
variant that has such a trait."""

from __future__ import annotations

import subprocess

import pytest

from actors.job.config.load import apply_overrides, decode_topology
from actors.runtime.config.estimators import ROWS as ESTIMATORS
from actors.runtime.config.estimators import EstimatorRow
from actors.runtime.config.losses import ROWS as LOSSES
from tests.jobs import ROOT, actor_pids, balanced, command, metrics, status_lines
from tests.learner_cases import OPTIONS

# the reward keys gdpo normalises, returned by every job's reward function here
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    acc = float(solution_str.strip()[:1] == str(ground_truth).strip()[:1])
    form = float(len(solution_str.strip()) > 0)
    return {"score": acc + 0.1 * form, "acc": acc, "format": form}
'''


def case(key: str, name: str) -> list[str]:
    """The learner tests' overrides for ``algorithm.KEY = NAME`` (the first case setting it)."""
    for overrides in OPTIONS.values():
        if f"algorithm.{key}={name}" in overrides:
            return overrides
    return []


# (a user's own loss or estimator trains in tests/test_custom_algorithms.py)
VARIANTS = [("adv_estimator", n) for n in ESTIMATORS if n != "custom"] + \
           [("policy_loss", n) for n in LOSSES if n not in ("vanilla", "custom")]


def changes_the_actors(key: str, name: str) -> bool:
    """Whether the variant's row has a trait that another actor, or the learner beyond its
    function, acts on (the rows' own ClassVars, read as the actors read them)."""
    if key == "policy_loss":
        return LOSSES[name].takes_correction
    row = ESTIMATORS[name]
    takes_components = row.reward_keys is not EstimatorRow.reward_keys  # the scorer's dict keys
    return row.greedy_baseline or row.critic or row.old_forward or takes_components


IN_JOBS = [(k, n) for k, n in VARIANTS if changes_the_actors(k, n)]


def test_every_variant_has_a_case_that_decodes():
    """A row needing an option it has no default for (dro's dro_beta) needs a case in
    tests/learner_cases.py; the others have one by their name alone."""
    assert [f"{k}={n}" for k, n in VARIANTS if k != "adv_estimator" or n != "grpo"
            if not case(k, n)] == []
    for key, name in VARIANTS:
        chosen = getattr(decode_topology(apply_overrides({}, case(key, name))).algorithm, key)
        assert chosen.name == name or (key, name) == ("adv_estimator", "grpo")


def test_the_variants_in_jobs_are_those_with_traits():
    """The selection reads the rows: if it ever picked none of a kind, no job would run it."""
    assert {k for k, _ in IN_JOBS} == {"adv_estimator", "policy_loss"}
    assert {"remax", "gae", "gdpo", "optimal_token_baseline", "bypass_mode"} <= {n for _, n in IN_JOBS}
    assert ("policy_loss", "gspo") not in IN_JOBS and ("adv_estimator", "rloo") not in IN_JOBS


@pytest.mark.slow
@pytest.mark.parametrize(("key", "name"), IN_JOBS, ids=[f"{k}={n}" for k, n in IN_JOBS])
def test_the_variant_trains_in_a_whole_job(tiny_model, tmp_path, key, name):
    (tmp_path / "reward.py").write_text(REWARD)
    run_dir = tmp_path / "run"
    overrides = [o for o in case(key, name) if not o.startswith("learner.micro_batch_size")]
    res = subprocess.run(command(tiny_model, run_dir, "learner.total_steps=3", "algorithm.n=4",
                                 f"reward.functions=[{{path='{tmp_path / 'reward.py'}'}}]",
                                 f"algorithm.{key}={name}", *overrides),
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(balanced(r) for r in rows)
    assert status_lines(run_dir)[-1]["outcome"] == "finished"
    assert not actor_pids(run_dir)
