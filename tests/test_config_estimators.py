"""Each advantage estimator's config row (``actors/runtime/config/estimators.py``, the
estimators' one registry) against the kernel (``kernels.advantages``): its ``load`` gives an
estimator function, its options are fields of ``AdvantageParams`` under the same names, and
its traits say which estimators take groups of unequal size; and the old shape (a name alone,
verl's flat keys) read as the new one."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest

from actors.job.config.load import apply_overrides, decode_topology
from actors.runtime.config import ConfigError
from actors.runtime.config.estimators import ROWS as ALL_ROWS
from actors.runtime.config.estimators import Custom
from kernels.advantages._common import AdvantageParams

ROWS = {n: r for n, r in ALL_ROWS.items() if r is not Custom}  # a user's own: its own tests


def _row(name):
    return ROWS[name](gdpo_reward_keys=["a"]) if name == "gdpo" else ROWS[name]()


@pytest.mark.parametrize("name", list(ROWS))
def test_each_rows_options_are_fields_of_the_kernels_params(name):
    row = _row(name)
    assert list(inspect.signature(row.load()).parameters)[:3] == [
        "token_level_rewards", "response_mask", "params"]
    params = {f.name for f in dataclasses.fields(AdvantageParams)}
    assert set(row.kernel_options()) <= params, set(row.kernel_options()) - params
    # every option of the row reaches the kernel under its own name, but those it says another
    # part reads
    assert set(row.kernel_options()) | set(row.read_elsewhere) == set(row.__struct_fields__)


def test_a_rows_code_is_imported_only_when_loaded():
    """The config reads the rows torch-free; the learner imports the chosen estimator's."""
    code = ("import sys; from actors.runtime.config.estimators import ROWS; "
            "assert 'torch' not in sys.modules; ROWS['rloo']().load(); "
            "assert 'kernels.advantages.rloo' in sys.modules; "
            "assert 'kernels.advantages.gae' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_bad_name_is_one_line_naming_it():
    with pytest.raises(ConfigError) as caught:
        decode_topology(apply_overrides({}, ["algorithm.adv_estimator=ppo"]))
    assert str(caught.value).startswith("algorithm.adv_estimator.name: 'ppo' is not one of grpo")


def test_what_an_estimator_needs_is_said_by_its_row():
    assert [n for n, r in ROWS.items() if r.greedy_baseline] == ["remax"]
    assert [n for n, r in ROWS.items() if r.critic] == ["gae"]
    assert [n for n, r in ROWS.items() if r.old_forward] == ["optimal_token_baseline",
                                                             "tir_optimal_token_baseline"]


def test_an_estimators_options_are_keys_of_its_table():
    t = decode_topology(apply_overrides({}, [
        "algorithm.adv_estimator=gae", "algorithm.adv_estimator.lam=0.95",
        "algorithm.adv_estimator.gamma=0.99"]))
    est = t.algorithm.adv_estimator
    assert (est.name, est.lam, est.gamma) == ("gae", 0.95, 0.99)
    with pytest.raises(ConfigError, match=r"^algorithm\.lam"):
        decode_topology(apply_overrides({}, ["algorithm.adv_estimator=gae", "algorithm.lam=0.95"]))
    plain = decode_topology(apply_overrides({}, ["algorithm.adv_estimator.norm_adv_by_std_in_grpo=false"]))
    assert plain.algorithm.adv_estimator.name == "grpo"  # a table without a name: the default's
    assert plain.algorithm.adv_estimator.kernel_options() == {"norm_adv_by_std_in_grpo": False}
