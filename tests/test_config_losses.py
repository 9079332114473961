"""Each policy loss's config row (``actors/runtime/config/losses.py``, the losses' one
registry) against its code: its ``load`` gives a loss function, every option of a row a keyword
argument of that function, so a row cannot name an option its code does not take. And the old
shape (a name alone, flat option keys) read as the new one."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from actors.job.config.load import apply_overrides, decode_topology
from actors.runtime.config import ConfigError
from actors.runtime.config.losses import ROWS as ALL_ROWS
from actors.runtime.config.losses import Custom

ROWS = {n: r for n, r in ALL_ROWS.items() if r is not Custom}  # a user's own: its own tests
LOADED = {n: (r(dro_beta=0.1) if n == "dro" else r()).load() for n, r in ROWS.items()}


@pytest.mark.parametrize("name", list(ROWS))
def test_each_rows_options_are_its_codes_keyword_arguments(name):
    fn = LOADED[name]
    takes = inspect.signature(fn).parameters
    assert list(takes)[:4] == ["logprobs", "old_logprobs", "advantages", "mask"], fn
    for option in ROWS[name].__struct_fields__:
        assert option in takes and takes[option].kind is inspect.Parameter.KEYWORD_ONLY, \
            f"{name}: {option} is not a keyword argument of {fn.__name__}"


def test_a_rows_code_is_imported_only_when_loaded():
    """The config reads the rows torch-free; the learner imports the chosen loss's module."""
    code = ("import sys; from actors.runtime.config.losses import ROWS; "
            "assert 'torch' not in sys.modules; ROWS['cispo']().load(); "
            "assert 'kernels.policy_losses.cispo' in sys.modules; "
            "assert 'kernels.policy_losses.sapo' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_losss_options_are_keys_of_its_table():
    a = decode_topology(apply_overrides({}, [
        "algorithm.policy_loss=sapo", "algorithm.policy_loss.tau_pos=1.3"]))
    assert a.algorithm.policy_loss.name == "sapo" and a.algorithm.policy_loss.tau_pos == 1.3
    with pytest.raises(ConfigError, match=r"^algorithm\.tau_pos"):
        decode_topology(apply_overrides({}, ["algorithm.policy_loss=sapo", "algorithm.tau_pos=1.3"]))
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


@pytest.mark.parametrize(("override", "said"), [
    ("algorithm.policy_loss=ppo", "algorithm.policy_loss.name: 'ppo' is not one of vanilla, "),
    ("algorithm.policy_loss.tau=1", "algorithm.policy_loss.tau: unknown key")])
def test_a_bad_name_or_key_is_one_line_naming_it(override, said):
    with pytest.raises(ConfigError) as caught:
        decode_topology(apply_overrides({}, [override]))
    assert str(caught.value).startswith(said) and "\n" not in str(caught.value)
