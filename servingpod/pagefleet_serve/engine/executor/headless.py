"""A node other than rank 0's (`pagefleet serve --headless`, a LeaderWorkerSet group's
other pods): it runs only its workers, which join rank 0's store at
`master_addr:master_port`. A remote rank that dies breaks the group's next collective
(rank 0's step fails, and the engine reports it dead); its node's process exits with it,
so a LeaderWorkerSet recreates the group."""

import logging
import multiprocessing.connection
import signal
import threading

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.cpu_placement import CpuPlacement, available_cpus, rank_placements
from pagefleet_serve.engine.executor.multiproc import JOIN_S, spawn_workers

logger = logging.getLogger(__name__)


def run_headless(config: EngineConfig) -> int:
    """Run this node's workers until they end. Exit status 0 when rank 0 shut them down,
    1 when one failed or rank 0 was lost; SIGTERM ends them (and so the group's
    collectives: a LeaderWorkerSet recreates the group)."""
    local = config.ranks_per_node
    placements = rank_placements(CpuPlacement(available_cpus(), None), local)
    processes = spawn_workers(config, range(local), placements, config.master_port or 0)
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
        process.join(JOIN_S)
        if process.is_alive():
            process.kill()
            process.join(JOIN_S)
    if stopped.is_set() or all(p.exitcode == 0 for p in processes):
        return 0
    for process in processes:
        logger.error("%s ended with exit status %s", process.name, process.exitcode)
    return 1
