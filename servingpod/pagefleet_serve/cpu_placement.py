"""Which CPUs the engine core's intra-op threads run on, and which the frontend (the API
process: HTTP, tokenization, text) keeps, so that they do not fight over the same cores.

`--cpu-threads-bind` (as vLLM's VLLM_CPU_OMP_THREADS_BIND): `auto`, `none`, or the core's
CPU list such as `0-2` or `0,2-3`; the frontend gets the CPUs left over. `auto`: with 4 or
more CPUs, the core takes all but the last one and the frontend that one; with fewer, both
share every CPU (one core for each would halve the model's threads, while the frontend is
idle most of each step), and the core runs one intra-op thread per CPU.

A container's CPU limit (the cgroup's CPU quota, what Kubernetes sets from
`resources.limits.cpu`) caps the threads: a pod limited to 2 CPUs on a 64-CPU node still
sees 64 in its affinity mask, and 64 intra-op threads on a 2-CPU quota spend most of each
step throttled or spinning at barriers. A quota is CPU time, not particular CPUs, so under
one `auto` pins nothing and sizes the thread count to the quota (the same split rule: from
4 CPUs of quota, one is left to the API process).

An explicit `OMP_NUM_THREADS` is the operator's thread count and wins over both rules (the
CPUs stay as planned): several servers sharing a few cores, each told to run one thread,
must not each start one thread per CPU and spin at each other's barriers.
"""

import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path

_MIN_CPUS_TO_SPLIT = 4
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuPlacement:
    core: list[int] | None  # None: not pinned
    frontend: list[int] | None
    core_threads: int | None = None  # the core's intra-op threads; None: torch's default


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]; ValueError names what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(
                f"cpu_threads_bind: cannot read {text!r} as a CPU list; use auto, none or "
                f"a list such as 0-2,4"
            )
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"cpu_threads_bind: range {part.strip()!r} runs backwards")
        cpus.update(range(low, high + 1))
    return sorted(cpus)


def plan_placement(
    spec: str, available: list[int], quota: float | None = None, threads: int | None = None
) -> CpuPlacement:
    """`quota`: the CPUs' worth of time the cgroup allows (None: unlimited); `threads`: the
    environment's OMP_NUM_THREADS (None: not set), which overrides the thread count."""
    placement = _plan_cpus(spec, sorted(available), quota)
    if threads is None or placement.core_threads is None:
        return placement
    return CpuPlacement(placement.core, placement.frontend, threads)


def _plan_cpus(spec: str, available: list[int], quota: float | None) -> CpuPlacement:
    if spec == "none":
        return CpuPlacement(None, None)
    if spec == "auto":
        usable = usable_cpus(available, quota)
        if usable < len(available):
            threads = usable - 1 if usable >= _MIN_CPUS_TO_SPLIT else usable
            return CpuPlacement(None, None, threads)
        if len(available) < _MIN_CPUS_TO_SPLIT:
            return CpuPlacement(available, None, len(available))
        return CpuPlacement(available[:-1], available[-1:], len(available) - 1)
    core = parse_cpu_list(spec)
    outside = sorted(set(core) - set(available))
    if outside:
        raise ValueError(
            f"cpu_threads_bind: CPUs {outside} are not available to this process "
            f"(available: {available})"
        )
    frontend = sorted(set(available) - set(core))
    return CpuPlacement(core, frontend or None, len(core))


def usable_cpus(available: list[int], quota: float | None) -> int:
    """CPUs this process can keep busy: those its affinity allows, no more than its
    cgroup's quota (rounded up)."""
    return len(available) if quota is None else min(len(available), math.ceil(quota))


def omp_num_threads(environ=os.environ) -> int | None:
    """OMP_NUM_THREADS as a thread count: its first (outermost) level, None when unset or
    not a positive integer (OpenMP ignores such a value too)."""
    first = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time this process's cgroup may use, or None when unlimited: cgroup v2
    `cpu.max` ("200000 100000" is 2 CPUs, "max 100000" none), else v1's
    `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none). Unreadable files: None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for v1 in ("cpu", "cpu,cpuacct"):
        try:
            quota = int((root / v1 / "cpu.cfs_quota_us").read_text())
            period = int((root / v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 or period <= 0 else quota / period
    return None


def place_core_threads(placement: CpuPlacement | None) -> None:
    """In the core process: pin it to the placement's CPUs (if any) and set its intra-op
    thread count (if set)."""
    if placement is None:
        return
    if placement.core is not None:
        os.sched_setaffinity(0, placement.core)
    if placement.core_threads is not None:
        import torch

        torch.set_num_threads(placement.core_threads)


def place_frontend(cpus: list[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def rank_placements(placement: CpuPlacement, size: int) -> list[CpuPlacement]:
    """Each tensor-parallel rank's share of the engine core's CPUs: contiguous groups (the
    first the larger), one intra-op thread per CPU of its group. Fewer CPUs than ranks, or
    none pinned: every rank unpinned, the thread count (if set) split among them."""
    cpus = placement.core
    if cpus is None or len(cpus) < size:
        threads = placement.core_threads
        return [
            CpuPlacement(None, None, None if threads is None else max(threads // size, 1))
        ] * size
    bounds = [-(-rank * len(cpus) // size) for rank in range(size + 1)]
    groups = [cpus[first:end] for first, end in itertools.pairwise(bounds)]
    return [CpuPlacement(group, None, len(group)) for group in groups]
