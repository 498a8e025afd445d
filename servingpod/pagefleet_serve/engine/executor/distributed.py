"""The `torch.distributed` side of the ranks, shared by rank 0's executor and the workers:
the process group (gloo on the CPU, NCCL on CUDA), each rank's device and name, the call
rank 0 broadcasts each step, and how a lost rank is told from a failed step."""

import datetime

import torch
import torch.distributed as dist

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.model.tensor_parallel import TensorParallel

# Rendezvous: how long the ranks have to find each other (a worker's spawn and imports).
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=300)
# A worker waits for the next step as long as the server idles: no timeout of its own. A
# dead rank closes its connections (its peers' collectives fail at once); a hung one is
# found by the core's step timeout.
_COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)


class WorkerLost(RuntimeError):
    """A tensor-parallel rank has died or cannot be reached (the group's collectives are
    broken: the engine cannot step again); the message names it when it is this node's."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective's transport failing (a peer rank gone), not the
    step's own error: NCCL's DistBackendError, gloo's RuntimeError from its transport."""
    if isinstance(exc, dist.DistBackendError):
        return True
    return isinstance(exc, RuntimeError) and "gloo/transport" in str(exc)


def distributed_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of a node's `local_rank`-th rank: that GPU counted from the configured
    one; the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + local_rank)


def join_group(
    store: dist.Store, rank: int, config: EngineConfig, device: torch.device
) -> TensorParallel:
    """Join the group as global rank `rank`; its place (and, in a pipeline, every stage's
    group made, as every rank must, its own stage's kept)."""
    dist.init_process_group(
        distributed_backend(device),
        store=store,
        rank=rank,
        world_size=config.world_size,
        timeout=_COLLECTIVE_TIMEOUT,
    )
    size, stages = config.tensor_parallel_size, config.pipeline_parallel_size
    group = None
    if stages > 1 and size > 1:
        groups = [
            dist.new_group(list(range(s * size, (s + 1) * size)), timeout=_COLLECTIVE_TIMEOUT)
            for s in range(stages)
        ]
        group = groups[rank // size]
    return TensorParallel(rank % size, size, rank // size, stages, group)


def rank_name(rank: int, config: EngineConfig) -> str:
    """'tensor-parallel rank 1', or in a pipeline 'rank 3 (pipeline stage 1)'."""
    if config.pipeline_parallel_size == 1:
        return f"tensor-parallel rank {rank}"
    return f"rank {rank} (pipeline stage {rank // config.tensor_parallel_size})"
