"""Tensor-parallel ranks as processes over `torch.distributed` (gloo on the CPU, NCCL on
CUDA): rank 0 lives in the engine's process with the scheduler; ranks 1..N-1 are started
here, forked from multiprocessing's fork server (which has imported torch once), each
running `worker.worker_main`: its own shard of the model (`model.tensor_parallel`) and its
own part of the KV cache.

Once per call that runs the model rank 0 broadcasts it, with its plain inputs
(`broadcast_object_list`); every rank then makes the same call, and their layers meet in
the all-reduces. Nothing else crosses: no transport of our own.

With pipeline parallelism the ranks form stages (`pipeline_parallel_size` of them, each of
`tensor_parallel_size` ranks, global rank = stage * tensor size + rank), each stage its own
process group for its all-reduces; a step's rows pass from stage to stage as point-to-point
sends of the same group, and the last stage's logits come back to rank 0. The stages run
one after the other (no micro-batches): a pipeline holds a model too large for one stage's
devices, it does not step faster.

A worker never outlives rank 0's process (PR_SET_PDEATHSIG on its parent, the fork
server, which exits with rank 0's process) and ignores SIGTERM/SIGINT (rank 0 ends it: a
shutdown call, then kill). A worker that dies closes its connections, so a collective of
rank 0 fails at once; `watch` tells rank 0's owner even between steps. Nodes other than
rank 0's run only workers (`headless`).
"""

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.cpu_placement import (
    CpuPlacement,
    available_cpus,
    place_core_threads,
    rank_placements,
)
from pagefleet_serve.engine.executor import worker
from pagefleet_serve.engine.executor.abstract import Executor
from pagefleet_serve.engine.executor.distributed import (
    RENDEZVOUS_TIMEOUT,
    WorkerLost,
    distributed_backend,
    is_collective_failure,
    join_group,
    rank_name,
)

logger = logging.getLogger(__name__)

JOIN_S = 10.0


class MultiprocExecutor(Executor):
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
            timeout=RENDEZVOUS_TIMEOUT,
            wait_for_workers=False,
        )
        self.processes = spawn_workers(config, range(1, local), ranks, store.port)
        try:
            super().__init__(join_group(store, 0, config, device))
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

    def on_every_rank(self, method: str, *args: object):
        try:
            dist.broadcast_object_list([worker.RunnerCall(method, args)], src=0)
        except RuntimeError as exc:
            raise self.lost(exc) from exc
        try:
            return getattr(self.runner, method)(*args)
        except Exception as exc:
            if is_collective_failure(exc):
                raise self.lost(exc) from exc  # a peer left in a collective
            raise

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
                dist.broadcast_object_list([worker.SHUTDOWN], src=0)
            except RuntimeError:
                logger.debug("could not ask the workers to stop", exc_info=True)
        for process in self.processes:
            process.join(JOIN_S)
            if process.is_alive():
                logger.warning("tensor-parallel worker %d did not stop: killing it", process.pid)
                process.kill()
                process.join(JOIN_S)
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_workers(
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
            target=worker.worker_main,
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
    """Workers fork from multiprocessing's fork server, which has imported torch and the
    worker's module once: a node's workers, and those of every later engine of this
    process, start without importing torch again (about 2 s of CPU each). The server runs
    no parallel region and opens no device, so its forks are clean; what a worker imports
    beyond its module it imports after taking its parent's environment (`worker_main`)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([worker.__name__])
    return context
