"""Process names as typed values: built and read in one place (``ProcessName``)."""

import pytest

from actors.runtime.config import ProcessName, of_kind


@pytest.mark.parametrize("name, parts", [
    ("sampler-2", ProcessName("sampler", 2)),
    ("reward-10", ProcessName("reward", 10)),
    ("learner-0", ProcessName("learner", 0, 0)),
    ("learner-0.rank3", ProcessName("learner", 0, 3)),
])
def test_a_name_and_its_parts_round_trip(name, parts):
    assert ProcessName.parse(name) == parts
    assert str(parts) == name


@pytest.mark.parametrize("name", ["sampler", "sampler-", "sampler-x", "-1", "learner-0.rank",
                                  "learner-0.rankx", "sampler-attached-123"])
def test_a_name_that_is_not_a_process_name_is_refused(name):
    with pytest.raises(ValueError, match="not a process name"):
        ProcessName.parse(name)


def test_of_kind_keeps_the_order_and_passes_over_other_names():
    names = ["learner-0.rank1", "sampler-3", "my-worker", "learner-0", "sampler-attached-7",
             "sampler-1"]
    assert of_kind("learner", names) == [ProcessName("learner", 0, 1), ProcessName("learner", 0)]
    assert [str(p) for p in sorted(of_kind("sampler", names))] == ["sampler-1", "sampler-3"]
