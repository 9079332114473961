"""Each policy loss's config row (``actors/runtime/config/losses.py``) against its kernel
(``kernels.policy_losses.POLICY_LOSSES``): the same names, and every option of a row a keyword
argument of its loss's function, so a row cannot name an option its kernel does not take. And
the old shape (a name alone, flat option keys) read as the new one."""

from __future__ import annotations

import inspect

import pytest

from actors.job.config.load import apply_overrides, decode_topology
from actors.runtime.config.losses import ROWS as ALL_ROWS
from actors.runtime.config.losses import Custom
from kernels.policy_losses import POLICY_LOSSES

ROWS = {n: r for n, r in ALL_ROWS.items() if r is not Custom}  # a user's own: its own tests


def test_the_rows_are_the_kernels_losses():
    assert list(ROWS) == list(POLICY_LOSSES)


@pytest.mark.parametrize("name", list(ROWS))
def test_each_rows_options_are_its_kernels_keyword_arguments(name):
    takes = inspect.signature(POLICY_LOSSES[name]).parameters
    for option in ROWS[name].__struct_fields__:
        assert option in takes and takes[option].kind is inspect.Parameter.KEYWORD_ONLY, \
            f"{name}: {option} is not a keyword argument of {POLICY_LOSSES[name].__name__}"


def test_flat_option_keys_are_read_as_the_chosen_losss_with_a_notice(capsys):
    a = decode_topology(apply_overrides({}, [
        "algorithm.policy_loss=sapo", "algorithm.tau_pos=1.3", "algorithm.dro_beta=0.5"]))
    assert a.algorithm.policy_loss.name == "sapo" and a.algorithm.policy_loss.tau_pos == 1.3
    err = capsys.readouterr().err
    assert "algorithm.tau_pos is now algorithm.policy_loss.tau_pos" in err
    assert "algorithm.dro_beta is an option of policy_loss dro " in err and "not read" in err
    table = decode_topology({"algorithm": {"policy_loss": {"name": "clip_cov",
                                                           "clip_cov_ratio": 0.01}}})
    assert table.algorithm.policy_loss.clip_cov_ratio == 0.01
    assert table.algorithm.policy_loss.clip_cov_ub == 5.0


def test_a_name_alone_then_an_option_of_it_on_the_command_line():
    a = decode_topology(apply_overrides({"algorithm": {"policy_loss": {"name": "sapo",
                                                                       "tau_pos": 2.0}}},
                                        ["algorithm.policy_loss=dro",
                                         "algorithm.policy_loss.dro_beta=0.2"]))
    assert a.algorithm.policy_loss.name == "dro" and a.algorithm.policy_loss.dro_beta == 0.2
