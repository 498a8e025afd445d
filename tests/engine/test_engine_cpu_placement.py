"""`--cpu-threads-bind`: which CPUs the engine core's threads and the API process get."""

import pytest
from pagefleet_serve.engine.cpu_placement import CpuPlacement, parse_cpu_list, plan_placement


@pytest.mark.parametrize(
    ("spec", "available", "placement"),
    [
        ("auto", [0, 1], CpuPlacement([0, 1], None)),  # too few to split: shared
        ("auto", [0, 1, 2, 3], CpuPlacement([0, 1, 2], [3])),
        ("auto", [4, 5, 6, 7, 8], CpuPlacement([4, 5, 6, 7], [8])),
        ("none", [0, 1, 2, 3], CpuPlacement(None, None)),
        ("0-1", [0, 1, 2, 3], CpuPlacement([0, 1], [2, 3])),
        ("0,1", [0, 1], CpuPlacement([0, 1], None)),  # nothing left: the API floats
        ("1", [0, 1], CpuPlacement([1], [0])),
    ],
)
def test_plan_placement(spec, available, placement):
    assert plan_placement(spec, available) == placement


def test_cpu_lists_read_ranges_and_singles():
    assert parse_cpu_list("0-2, 5,7-8") == [0, 1, 2, 5, 7, 8]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("all", "cannot read 'all' as a CPU list"),
        ("3-1", "runs backwards"),
        ("0-9", r"CPUs \[2, 3, 4, 5, 6, 7, 8, 9\] are not available"),
    ],
)
def test_bad_specs_name_the_flag_and_what_is_allowed(spec, message):
    with pytest.raises(ValueError, match=message) as error:
        plan_placement(spec, [0, 1])
    assert str(error.value).startswith("cpu_threads_bind: ")
