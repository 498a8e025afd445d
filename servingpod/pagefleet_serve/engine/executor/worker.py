"""What each rank other than 0 runs, in a process of its own: join the group, load its
shard into a `ModelRunner` of its own (its part of the KV cache too: its key/value heads
over the same block ids), then make every call rank 0's executor broadcasts, with the same
inputs as rank 0, until told to stop. Its layers meet rank 0's in their collectives;
nothing else crosses."""

import logging
import os
import signal
from dataclasses import dataclass, replace

import torch.distributed as dist

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.cpu_placement import CpuPlacement, place_core_threads
from pagefleet_serve.engine.device import RunnerConfig, resolve_device
from pagefleet_serve.engine.executor.distributed import (
    RENDEZVOUS_TIMEOUT,
    join_group,
    rank_device,
    rank_name,
)
from pagefleet_serve.engine.lifetime import die_with_parent

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerCall:
    """A `ModelRunner` method every worker calls with rank 0 (its args plain data)."""

    method: str
    args: tuple = ()


SHUTDOWN = RunnerCall("shutdown")
# What a worker's runner may be asked to do (see `Executor`).
RUNNER_CALLS = ("allocate_kv_cache", "forward_batch", "warm_up", "warm_up_kernels", "load_lora")


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
        config.master_addr, port, config.world_size, is_master=False, timeout=RENDEZVOUS_TIMEOUT
    )
    tp = join_group(store, rank, config, device)
    try:
        backend = get_kernel_backend(runner_config.attention_backend, device)
        loaded = load_model(
            config.model, runner_config.dtype, runner_config.weight_quantization, tp, backend
        )
        runner = ModelRunner(loaded, runner_config, tp=tp, samples=False)
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
        if call == SHUTDOWN:
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
