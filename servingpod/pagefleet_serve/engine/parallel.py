"""Tensor-parallel ranks as processes over `torch.distributed` (gloo on the CPU, NCCL on
CUDA): rank 0 lives in the engine's process with the scheduler; ranks 1..N-1 are started
here, forked from multiprocessing's fork server (which has imported torch once), each
loading its own shard of the model (`model.tensor_parallel`) and its own part of the KV
cache (its key/value heads, over the same block ids: the block manager and the block
tables stay rank 0's).

Once per step rank 0 broadcasts the runner call it is about to make, with its plain
inputs (`broadcast_object_list`); every rank then makes the same call, and their layers
meet in the all-reduces. Nothing else crosses: no transport of our own.

With pipeline parallelism the ranks form stages (`pipeline_parallel_size` of them, each of
`tensor_parallel_size` ranks, global rank = stage * tensor size + rank), each stage its own
process group for its all-reduces; a step's rows pass from stage to stage as point-to-point
sends of the same group, and the last stage's logits come back to rank 0. The stages run
one after the other (no micro-batches): a pipeline holds a model too large for one stage's
devices, it does not step faster.

A worker never outlives rank 0's process (PR_SET_PDEATHSIG on its parent, the fork
server, which exits with rank 0's process) and ignores SIGTERM/SIGINT (rank 0 ends it: a
shutdown call, then kill). A worker that dies closes its connections, so a collective of
rank 0 fails at once; `watch` tells rank 0's owner even between steps.

Across nodes (`nnodes` > 1, e.g. the pods of a LeaderWorkerSet group) each node holds
`ranks_per_node` ranks: node 0 rank 0 and its local workers, as above; every other node
runs only its workers (`run_headless`, `pagefleet serve --headless`), which join rank 0's
store at `master_addr:master_port`. A remote rank that dies breaks the group's next
collective (rank 0's step fails, and the engine reports it dead); its node's process
exits with it, so a LeaderWorkerSet recreates the group.
"""

import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.cpu_placement import (
    CpuPlacement,
    available_cpus,
    place_core_threads,
    rank_placements,
)
from pagefleet_serve.engine.device import RunnerConfig, resolve_device
from pagefleet_serve.model.tensor_parallel import NO_PARALLEL, TensorParallel

logger = logging.getLogger(__name__)

# Rendezvous: how long the ranks have to find each other (a worker's spawn and imports).
_RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=300)
# A worker waits for the next step as long as the server idles: no timeout of its own. A
# dead rank closes its connections (its peers' collectives fail at once); a hung one is
# found by the core's step timeout.
_COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
_JOIN_S = 10.0


@dataclass(frozen=True)
class RunnerCall:
    """A `ModelRunner` method every worker calls with rank 0 (its args plain data)."""

    method: str
    args: tuple = ()


_SHUTDOWN = RunnerCall("shutdown")
# What a worker's runner may be asked to do.
RUNNER_CALLS = ("allocate_kv_cache", "free_kv_cache", "forward_batch")


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


def _join(
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


class Workers:
    """Rank 0's side: starts ranks 1..N-1, has them make each runner call, ends them."""

    def __init__(
        self, config: EngineConfig, device: torch.device, placement: CpuPlacement | None
    ) -> None:
        """`placement`: the CPUs of every rank together (the engine core's plan), rank 0
        then pinned to its group; None: workers share this process's CPUs, and rank 0's
        threads are left as they are (an engine embedded in a caller's process)."""
        self.size = config.world_size
        self.config = config
        local = config.ranks_per_node  # node 0's: rank 0 and ranks 1..local-1
        ranks = rank_placements(placement or CpuPlacement(available_cpus(), None), local)
        if placement is not None:
            place_core_threads(ranks[0])
        self._closing = False
        # The store first, on a port it picks (or --master-port), then the workers.
        store = dist.TCPStore(
            config.master_addr,
            config.master_port or 0,
            self.size,
            is_master=True,
            timeout=_RENDEZVOUS_TIMEOUT,
            wait_for_workers=False,
        )
        self.processes = _spawn_workers(config, range(1, local), ranks, store.port)
        try:
            self.tp = _join(store, 0, config, device)
        except BaseException:
            self.close()
            raise
        logger.info(
            "parallel: %d ranks (tensor %d x pipeline %d) over %s, workers %s",
            self.size,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            distributed_backend(device),
            ", ".join(str(p.pid) for p in self.processes) or "on other nodes",
        )

    def call(self, method: str, *args) -> None:
        """Have every worker's runner call `method(*args)` (rank 0 makes the same call)."""
        try:
            dist.broadcast_object_list([RunnerCall(method, args)], src=0)
        except RuntimeError as exc:
            raise self.lost(exc) from exc

    def lost(self, exc: BaseException) -> WorkerLost:
        """The WorkerLost for a failed collective: which rank of this node exited, or that
        one (of another node's, or unreachable) is gone."""
        return WorkerLost(
            self.lost_reason() or f"a parallel rank is gone (a collective failed: {exc})"
        )

    def lost_reason(self) -> str | None:
        """Which worker has exited, and how; None while all run."""
        for rank, process in enumerate(self.processes, start=1):
            code = process.exitcode
            if code is None:
                continue
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited ({code})"
            return f"{rank_name(rank, self.config)} (pid {process.pid}) {how}"
        return None

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Call `on_lost(reason)`, from a thread of its own, when a worker exits unasked
        (this node's: another node's lost rank fails the next step's collectives)."""
        if not self.processes:
            return

        def wait() -> None:
            ready = multiprocessing.connection.wait([p.sentinel for p in self.processes])
            for process in self.processes:
                if process.sentinel in ready:
                    # The sentinel closes as the process exits, a moment before it can be
                    # reaped: wait for its exit status, which names the signal.
                    process.join(timeout=2)
            if not self._closing:
                on_lost(self.lost_reason() or "a parallel rank has exited")

        threading.Thread(target=wait, name="tensor-parallel-watch", daemon=True).start()

    def close(self) -> None:
        """End every worker (asked, then killed) and leave the process group."""
        if self._closing:
            return
        self._closing = True
        if dist.is_initialized() and self.lost_reason() is None:
            try:
                dist.broadcast_object_list([_SHUTDOWN], src=0)
            except RuntimeError:
                logger.debug("could not ask the workers to stop", exc_info=True)
        for process in self.processes:
            process.join(_JOIN_S)
            if process.is_alive():
                logger.warning("tensor-parallel worker %d did not stop: killing it", process.pid)
                process.kill()
                process.join(_JOIN_S)
        if dist.is_initialized():
            dist.destroy_process_group()


def start_workers(
    config: EngineConfig, device: torch.device, placement: CpuPlacement | None
) -> tuple[Workers | None, TensorParallel]:
    """The workers of a parallel engine (None at one rank) and rank 0's place."""
    if config.world_size == 1:
        return None, NO_PARALLEL
    workers = Workers(config, device, placement)
    return workers, workers.tp


def _spawn_workers(
    config: EngineConfig, local_ranks: range, placements: list[CpuPlacement], port: int
) -> list[multiprocessing.process.BaseProcess]:
    """Start this node's workers (their local ranks; global rank = node_rank *
    ranks_per_node + local rank), joining the store at `master_addr:port`."""
    context = _worker_context()
    log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    first = config.node_rank * config.ranks_per_node
    environment = dict(os.environ)
    processes = [
        context.Process(
            target=worker_main,
            args=(
                first + local,
                local,
                config,
                placements[local],
                port,
                log_level,
                environment,
            ),
            name=f"pagefleet-tp-rank-{first + local}",
            daemon=True,
        )
        for local in local_ranks
    ]
    for process in processes:
        process.start()
    return processes


def _worker_context() -> multiprocessing.context.BaseContext:
    """Workers fork from multiprocessing's fork server, which has imported torch and this
    module once: a node's workers, and those of every later engine of this process, start
    without importing torch again (about 2 s of CPU each). The server runs no parallel
    region and opens no device, so its forks are clean; what a worker imports beyond this
    module it imports after taking its parent's environment (`worker_main`)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def run_headless(config: EngineConfig) -> int:
    """A node other than rank 0's (`--headless`): run its workers until they end. Exit
    status 0 when rank 0 shut them down, 1 when one failed or rank 0 was lost; SIGTERM
    ends them (and so the group's collectives: a LeaderWorkerSet recreates the group)."""
    local = config.ranks_per_node
    placements = rank_placements(CpuPlacement(available_cpus(), None), local)
    processes = _spawn_workers(config, range(local), placements, config.master_port or 0)
    stopped = threading.Event()

    def stop(signum: int, frame: object) -> None:
        stopped.set()
        for process in processes:
            if process.is_alive():
                process.kill()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    logger.info(
        "node %d of %d: tensor-parallel ranks %s joining %s:%s",
        config.node_rank,
        config.nnodes,
        ", ".join(p.name.rsplit("-", 1)[1] for p in processes),
        config.master_addr,
        config.master_port,
    )
    # One rank gone ends the node: the others' next collective would fail anyway. Rank
    # 0's shutdown reaches every worker at once; the others are given a moment, then ended.
    multiprocessing.connection.wait([p.sentinel for p in processes])
    for process in processes:
        process.join(_JOIN_S)
        if process.is_alive():
            process.kill()
            process.join(_JOIN_S)
    if stopped.is_set() or all(p.exitcode == 0 for p in processes):
        return 0
    for process in processes:
        logger.error("%s ended with exit status %s", process.name, process.exitcode)
    return 1


# -- a worker ---------------------------------------------------------------------------
def worker_main(
    rank: int,
    local_rank: int,
    config: EngineConfig,
    placement: CpuPlacement,
    port: int,
    log_level: str,
    environment: dict[str, str],
) -> None:
    """A forked rank: join the group, load this rank's shard, make every call rank 0
    broadcasts until it says stop (or is gone). `environment` is its parent's at the
    start (the fork server's is that of its own start): read before any import that
    reads it (huggingface_hub reads HF_HOME and HF_ENDPOINT when imported)."""
    os.environ.clear()
    os.environ.update(environment)
    from pagefleet_serve.attention import get_kernel_backend
    from pagefleet_serve.engine.core_process import die_with_parent
    from pagefleet_serve.engine.model_runner import ModelRunner
    from pagefleet_serve.model.loader.model_loader import load_model

    # Its parent is the fork server, which exits when rank 0's process does (its end of
    # the server's pipe closes), and this process with it.
    die_with_parent(os.getppid())
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 ends it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[tp{rank}]: %(message)s",
    )
    place_core_threads(placement)
    device = rank_device(resolve_device(config.device), local_rank)
    runner_config = RunnerConfig.of(replace(config, device=str(device)))  # made current
    store = dist.TCPStore(
        config.master_addr, port, config.world_size, is_master=False, timeout=_RENDEZVOUS_TIMEOUT
    )
    tp = _join(store, rank, config, device)
    try:
        backend = get_kernel_backend(runner_config.attention_backend, device)
        loaded = load_model(
            config.model, runner_config.dtype, runner_config.weight_quantization, tp, backend
        )
        runner = ModelRunner(loaded, runner_config, tp=tp)
        del loaded
    except BaseException:  # rank 0 hears of it as this process's exit
        logger.exception("%s could not load %s", rank_name(rank, config), config.model)
        os._exit(1)
    while True:
        message: list = [None]
        try:
            dist.broadcast_object_list(message, src=0)
        except RuntimeError:  # rank 0 is gone
            os._exit(1)
        call = message[0]
        if call == _SHUTDOWN:
            break
        if call.method not in RUNNER_CALLS:
            logger.error("%s: unknown call %r", rank_name(rank, config), call.method)
            continue
        try:
            getattr(runner, call.method)(*call.args)
        except Exception:
            logger.exception("%s: %s failed", rank_name(rank, config), call.method)
            if tp.stages > 1:  # its stage's output is what another stage waits for
                os._exit(1)
            # else rank 0 failed the same call (the same inputs)
    dist.destroy_process_group()
    logging.shutdown()
    os._exit(0)
