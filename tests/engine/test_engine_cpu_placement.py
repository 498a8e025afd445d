"""`--cpu-threads-bind`: which CPUs the engine core's threads and the API process get, and
how many threads the core runs (capped by the container's CPU limit)."""

import os
import subprocess
import sys

import pytest
from pagefleet_serve.cpu_placement import (
    CpuPlacement,
    cpu_quota,
    omp_num_threads,
    parse_cpu_list,
    plan_placement,
)

EIGHT = list(range(8))


@pytest.mark.parametrize(
    ("spec", "available", "quota", "placement"),
    [
        ("auto", [0, 1], None, CpuPlacement([0, 1], None, 2)),  # too few to split: shared
        ("auto", [0, 1, 2, 3], None, CpuPlacement([0, 1, 2], [3], 3)),
        ("auto", [4, 5, 6, 7, 8], None, CpuPlacement([4, 5, 6, 7], [8], 4)),
        ("none", [0, 1, 2, 3], None, CpuPlacement(None, None)),
        ("0-1", [0, 1, 2, 3], None, CpuPlacement([0, 1], [2, 3], 2)),
        ("0,1", [0, 1], None, CpuPlacement([0, 1], None, 2)),  # nothing left: the API floats
        ("1", [0, 1], None, CpuPlacement([1], [0], 1)),
        # A CPU limit below the CPUs in sight: no pinning (a quota is time on any CPU),
        # threads sized to the quota, rounded up; from 4, one is left to the API process.
        ("auto", EIGHT, 2.0, CpuPlacement(None, None, 2)),
        ("auto", EIGHT, 1.5, CpuPlacement(None, None, 2)),
        ("auto", EIGHT, 0.5, CpuPlacement(None, None, 1)),
        ("auto", EIGHT, 6.0, CpuPlacement(None, None, 5)),
        # A limit at or above the CPUs in sight changes nothing.
        ("auto", [0, 1], 2.0, CpuPlacement([0, 1], None, 2)),
        ("auto", [0, 1, 2, 3], 16.0, CpuPlacement([0, 1, 2], [3], 3)),
        # Explicit choices are the operator's: a list or none stays as given.
        ("0-3", EIGHT, 2.0, CpuPlacement([0, 1, 2, 3], [4, 5, 6, 7], 4)),
        ("none", EIGHT, 2.0, CpuPlacement(None, None)),
    ],
)
def test_plan_placement(spec, available, quota, placement):
    assert plan_placement(spec, available, quota) == placement


@pytest.mark.parametrize(
    ("spec", "available", "quota", "placement"),
    [
        # OMP_NUM_THREADS=1: the count is the operator's, the CPUs stay as planned.
        ("auto", [0, 1], None, CpuPlacement([0, 1], None, 1)),
        ("auto", [0, 1, 2, 3], None, CpuPlacement([0, 1, 2], [3], 1)),
        ("auto", EIGHT, 6.0, CpuPlacement(None, None, 1)),
        ("0-3", EIGHT, None, CpuPlacement([0, 1, 2, 3], [4, 5, 6, 7], 1)),
        ("none", EIGHT, None, CpuPlacement(None, None)),  # torch reads it itself
    ],
)
def test_omp_num_threads_sets_the_count(spec, available, quota, placement):
    """Three 1-thread servers on two cores each ran two threads under `auto`, and their
    spinning barriers made a lone prefill 1.5-3x slower (benchmarks/bench_router.py)."""
    assert plan_placement(spec, available, quota, threads=1) == placement


@pytest.mark.parametrize(
    ("value", "threads"),
    [("1", 1), (" 6 ", 6), ("4,2", 4), ("0", None), ("-2", None), ("two", None), ("", None)],
)
def test_omp_num_threads_reads_the_outer_level(value, threads):
    assert omp_num_threads({"OMP_NUM_THREADS": value}) == threads
    assert omp_num_threads({}) is None


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "200000 100000\n"}, 2.0),  # cgroup v2, limits.cpu: 2
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),  # no limit
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
        (
            {"cpu,cpuacct/cpu.cfs_quota_us": "300000", "cpu,cpuacct/cpu.cfs_period_us": "100000"},
            3.0,
        ),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1 none
        ({"cpu.max": "garbage"}, None),
        ({}, None),  # no cgroup files at all
    ],
)
def test_cpu_quota_reads_cgroup_v2_then_v1(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(tmp_path) == quota


def test_core_process_runs_the_placements_threads_on_its_cpus():
    """What the engine core process does first: pinned to the placement's CPUs, with its
    thread count (a fresh interpreter, as the core process is)."""
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import os, torch\n"
        "from pagefleet_serve.cpu_placement import CpuPlacement, place_core_threads\n"
        f"place_core_threads(CpuPlacement([{cpu}], None, 1))\n"
        "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())\n"
        "place_core_threads(CpuPlacement(None, None, 3))\n"
        "print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert out == [f"[{cpu}] 1", f"[{cpu}] 3"]


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


def test_tensor_parallel_ranks_get_their_own_cpus():
    from pagefleet_serve.cpu_placement import rank_placements

    three = rank_placements(CpuPlacement([0, 1, 2, 3, 4], [5], 5), 2)
    assert three == [CpuPlacement([0, 1, 2], None, 3), CpuPlacement([3, 4], None, 2)]
    # Fewer CPUs than ranks, or none pinned: unpinned, the thread count shared out.
    assert rank_placements(CpuPlacement([0], None, 1), 2) == [CpuPlacement(None, None, 1)] * 2
    assert rank_placements(CpuPlacement(None, None, 8), 4) == [CpuPlacement(None, None, 2)] * 4
