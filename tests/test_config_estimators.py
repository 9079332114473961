"""Each advantage estimator's config row (``actors/runtime/config/estimators.py``) against its
kernel (``kernels.advantages``): the same names, its options passed as keyword arguments
``compute_advantages`` takes, the estimators taking groups of unequal size the kernels' own
list; and the old shape (a name alone, verl's flat keys) read as the new one."""

from __future__ import annotations

import inspect

import pytest

from actors.job.config.load import apply_overrides, decode_topology
from actors.runtime.config.estimators import ROWS as ALL_ROWS
from actors.runtime.config.estimators import UNEQUAL_GROUP_ESTIMATORS, Custom
from kernels.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from kernels.advantages.unequal import UNEQUAL_GROUPS

ROWS = {n: r for n, r in ALL_ROWS.items() if r is not Custom}  # a user's own: its own tests


def test_the_rows_are_the_kernels_estimators():
    assert list(ROWS) == list(ADVANTAGE_ESTIMATORS)
    assert set(UNEQUAL_GROUP_ESTIMATORS) == set(UNEQUAL_GROUPS)


@pytest.mark.parametrize("name", list(ROWS))
def test_each_rows_options_are_keyword_arguments_of_compute_advantages(name):
    takes = inspect.signature(compute_advantages).parameters
    extra = {"gdpo_reward_keys", "gdpo_reward_weights"}  # the trainer's inputs for gdpo
    row = ROWS[name](gdpo_reward_keys=["a"]) if name == "gdpo" else ROWS[name]()
    for option in row.kernel_options():
        assert option in takes and takes[option].kind is inspect.Parameter.KEYWORD_ONLY, \
            f"{name}: {option} is not a keyword argument of compute_advantages"
    # every option of the row reaches the kernel, under its name or verl's
    fields = set(ROWS[name].__struct_fields__) - extra - {"cliprange_value"}
    assert len(fields) <= len(row.kernel_options()), (name, fields, row.kernel_options())


def test_what_an_estimator_needs_is_said_by_its_row():
    assert [n for n, r in ROWS.items() if r.greedy_baseline] == ["remax"]
    assert [n for n, r in ROWS.items() if r.critic] == ["gae"]
    assert [n for n, r in ROWS.items() if r.old_forward] == ["optimal_token_baseline",
                                                             "tir_optimal_token_baseline"]


def test_verls_flat_keys_are_read_as_the_chosen_estimators_with_a_notice(capsys):
    t = decode_topology(apply_overrides({}, [
        "algorithm.adv_estimator=gae", "algorithm.lam=0.95", "algorithm.gamma=0.99",
        "algorithm.norm_adv_by_std_in_grpo=false"]))
    est = t.algorithm.adv_estimator
    assert (est.name, est.lam, est.gamma) == ("gae", 0.95, 0.99)
    err = capsys.readouterr().err
    assert "algorithm.lam is now algorithm.adv_estimator.lam" in err
    assert ("algorithm.norm_adv_by_std_in_grpo is an option of adv_estimator grpo, grpo_passk, "
            "gdpo" in err and "not read" in err)
    plain = decode_topology(apply_overrides({}, ["algorithm.adv_estimator.norm_adv_by_std_in_grpo=false"]))
    assert plain.algorithm.adv_estimator.name == "grpo"  # a table without a name: the default's
    assert plain.algorithm.adv_estimator.kernel_options() == {"norm_adv_by_std": False}
