import math

import pytest
import torch

from kernels.staleness import staleness_histogram


def test_histogram_hand_case():
    got = staleness_histogram(torch.tensor([0, 0, 1, 3, 12.0]), max_bucket=4)
    assert got == pytest.approx(
        {
            "staleness/0": 0.4,
            "staleness/1": 0.2,
            "staleness/2": 0.0,
            "staleness/3": 0.2,
            "staleness/4+": 0.2,
            "staleness/mean": 3.2,
            "staleness/max": 12.0,
        }
    )


def test_same_keys_every_step():
    a = staleness_histogram(torch.tensor([0]))
    b = staleness_histogram(torch.tensor([[1, 9], [2, 2]]))
    assert set(a) == set(b)
    assert sum(v for k, v in b.items() if k[10:11].isdigit()) == pytest.approx(1.0)
    empty = staleness_histogram(torch.tensor([], dtype=torch.long))
    assert set(empty) == set(a) and math.isnan(empty["staleness/mean"])


@pytest.mark.parametrize(("lags", "match"), [([0, -1], "-1"), ([0.5], "0.5"), ([math.nan], "nan")])
def test_bad_lags(lags, match):
    with pytest.raises(ValueError, match=match):
        staleness_histogram(torch.tensor(lags))
    with pytest.raises(ValueError, match="max_bucket must be >= 1, got 0"):
        staleness_histogram(torch.tensor([0]), max_bucket=0)
