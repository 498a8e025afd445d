"""Which CPUs the engine core's intra-op threads run on, and which the frontend (the API
process: HTTP, tokenization, text) keeps, so that they do not fight over the same cores.

`--cpu-threads-bind` (as vLLM's VLLM_CPU_OMP_THREADS_BIND): `auto`, `none`, or the core's
CPU list such as `0-2` or `0,2-3`; the frontend gets the CPUs left over. `auto`: with 4 or
more CPUs, the core takes all but the last one and the frontend that one; with fewer, both
share every CPU (one core for each would halve the model's threads, while the frontend is
idle most of each step), and the core runs one intra-op thread per CPU.
"""

import os
from dataclasses import dataclass

_MIN_CPUS_TO_SPLIT = 4


@dataclass(frozen=True)
class CpuPlacement:
    core: list[int] | None  # None: not pinned (torch's default threads)
    frontend: list[int] | None


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


def plan_placement(spec: str, available: list[int]) -> CpuPlacement:
    available = sorted(available)
    if spec == "none":
        return CpuPlacement(None, None)
    if spec == "auto":
        if len(available) < _MIN_CPUS_TO_SPLIT:
            return CpuPlacement(available, None)
        return CpuPlacement(available[:-1], available[-1:])
    core = parse_cpu_list(spec)
    outside = sorted(set(core) - set(available))
    if outside:
        raise ValueError(
            f"cpu_threads_bind: CPUs {outside} are not available to this process "
            f"(available: {available})"
        )
    frontend = sorted(set(available) - set(core))
    return CpuPlacement(core, frontend or None)


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def place_core_threads(cpus: list[int] | None) -> None:
    """In the core process: pin it to `cpus` and run one intra-op thread per CPU."""
    if cpus is None:
        return
    import torch

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def place_frontend(cpus: list[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
