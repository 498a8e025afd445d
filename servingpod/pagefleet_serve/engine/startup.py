"""An engine's start-up, phase by phase (each phase's seconds are logged, and exported by
the server as a gauge): the kernels imported, the executor started (tensor-parallel ranks
begin loading their shards meanwhile), the model downloaded and loaded into rank 0's
runner (with a draft model, or an embed engine's pooler), the KV cache sized and allocated,
the kernels warmed up. What it made is a `StartedModel`; a start-up that fails ends the
ranks it started."""

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pagefleet_kernels.backend import KernelBackend

from pagefleet_serve.attention import get_kernel_backend
from pagefleet_serve.config import EngineConfig, PoolingConfig
from pagefleet_serve.cpu_placement import CpuPlacement
from pagefleet_serve.engine.device import RunnerConfig, kv_cache_bytes
from pagefleet_serve.engine.executor.abstract import Executor
from pagefleet_serve.engine.executor.multiproc import MultiprocExecutor
from pagefleet_serve.engine.executor.uniproc import UniprocExecutor
from pagefleet_serve.engine.model_runner import ModelRunner
from pagefleet_serve.engine.pooler import Pooler
from pagefleet_serve.engine.spec_decode.draft_model import check_vocabulary
from pagefleet_serve.model.config import ModelConfig
from pagefleet_serve.model.loader.model_loader import load_local, load_model
from pagefleet_serve.model.loader.resolve import resolve_model_uri
from pagefleet_serve.model.pooling import read_pooling_config, resolve_task

logger = logging.getLogger(__name__)


class _Phases:
    """`with phases("name"):` adds the block's seconds to `seconds["name"]`."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds

    @contextlib.contextmanager
    def __call__(self, name: str):
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - started


@dataclass
class StartedModel:
    """The model an engine serves, loaded on every rank, its KV cache allocated."""

    executor: Executor
    name: str
    config: ModelConfig
    pooling: PoolingConfig | None  # task embed: how every request is pooled; None: generate
    max_model_len: int
    num_blocks: int
    startup_seconds: dict[str, float]


def start_model(config: EngineConfig, placement: CpuPlacement | None) -> StartedModel:
    """`placement`: the CPUs of the engine's threads, which tensor-parallel ranks share
    out (see `MultiprocExecutor`)."""
    runner_config = RunnerConfig.of(config)
    device = runner_config.device
    started = time.monotonic()
    seconds: dict[str, float] = {}
    phase = _Phases(seconds)
    with phase("kernel_load"):  # the C++ extensions are imported here, compiled never
        backend = get_kernel_backend(runner_config.attention_backend, device)
    weights_started = time.monotonic()
    executor: Executor = (
        UniprocExecutor()
        if config.world_size == 1
        else MultiprocExecutor(config, device, placement)
    )
    try:
        # Nothing to download for a local or cached model; a sharded hf:// checkpoint's
        # shards go on downloading while the weight load reads those that have arrived.
        with phase("download"):
            local = resolve_model_uri(config.model, weights="background")
        weights_started += seconds["download"]
        # An embedding checkpoint saved without its head (transformers' `AutoModel`) scores
        # with its embedding table, which an embed engine never multiplies by except in its
        # warm-up.
        headless = resolve_task(config.task, local.path) == "embed"
        loaded = load_local(
            local,
            runner_config.dtype,
            runner_config.weight_quantization,
            executor.tp,
            backend,
            headless,
        )
        name, model_config = loaded.name, loaded.config
        spec = config.speculative_config
        # A draft model is not split: it runs on rank 0.
        draft = (
            _load_draft(spec.model, runner_config, backend, model_config)
            if spec and spec.model
            else None
        )
        pooling = _pooling_config(config, local.path, model_config.hidden_size)
        pooler = None if pooling is None else Pooler(pooling)
        executor.runner = ModelRunner(loaded, runner_config, draft, pooler, executor.tp)
        del loaded
        seconds["weight_load"] = time.monotonic() - weights_started
        logger.info(
            "model %s: %d layers, %d heads (%d kv), loaded in %.1fs",
            name,
            model_config.num_layers,
            model_config.num_heads,
            model_config.num_kv_heads,
            time.monotonic() - started,
        )
        logger.info("device %s, dtype %s", device, str(runner_config.dtype).removeprefix("torch."))
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        num_blocks = _allocate_kv_cache(config, executor, max_model_len, phase)
        if device.type != "cuda":  # CUDA's warm-up ran before the KV cache was sized
            with phase("warm_up"):
                executor.warm_up_kernels(config.max_num_seqs)
    except BaseException:
        executor.close()
        raise
    return StartedModel(executor, name, model_config, pooling, max_model_len, num_blocks, seconds)


def _load_draft(
    uri: str, config: RunnerConfig, backend: KernelBackend, target: ModelConfig
) -> ModelRunner:
    """The draft model's runner (speculative decoding), with the target's runner
    configuration (dtype, quantization, attention backend, KV cache dtype)."""
    loaded = load_model(uri, config.dtype, config.weight_quantization, backend=backend)
    check_vocabulary(loaded, target)
    logger.info("draft model %s: %d layers", loaded.name, loaded.config.num_layers)
    # Proposals come from the base draft: verification applies the target's adapters.
    return ModelRunner(loaded, replace(config, max_loras=0, max_lora_rank=0))


def _pooling_config(
    config: EngineConfig, path: Path | None, hidden_size: int
) -> PoolingConfig | None:
    """How this engine pools when its task (auto: from the model's files) is embed."""
    if resolve_task(config.task, path) != "embed":
        return None
    if config.speculative_config is not None:
        raise ValueError(
            f"{config.model} is an embedding model (task embed), which never "
            "decodes: drop speculative_config"
        )
    pooling = read_pooling_config(path, hidden_size)
    logger.info(
        "task embed: %s pooling, %snormalised, %d dimensions",
        pooling.method,
        "" if pooling.normalize else "not ",
        pooling.dimensions,
    )
    return pooling


def _allocate_kv_cache(
    config: EngineConfig, executor: Executor, max_model_len: int, phase: _Phases
) -> int:
    """Size the KV cache pool (on CUDA after the warm-up, whose activation peak is kept out
    of it) and allocate it on every rank; its number of blocks. With a draft model a block
    holds both models' K/V: the budget buys both at once."""
    started = time.monotonic()
    runner = executor.runner

    def warm_up() -> int:
        with phase("warm_up"):
            return executor.warm_up(
                config.max_num_batched_tokens, max_model_len, config.max_num_seqs
            )

    num_blocks = kv_cache_bytes(config, runner.device, warm_up) // runner.bytes_per_block
    pool_tokens = num_blocks * config.block_size
    if max_model_len > pool_tokens:
        raise ValueError(
            f"max_model_len ({max_model_len} tokens) does not fit in the KV cache pool "
            f"({pool_tokens} tokens = {num_blocks} blocks of {config.block_size}); raise "
            f"kv_cache_memory_bytes or lower max_model_len"
        )
    executor.allocate_kv_cache(num_blocks)
    phase.seconds["kv_cache"] = time.monotonic() - started - phase.seconds.get("warm_up", 0.0)
    logger.info(
        "KV cache pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%s), %s",
        num_blocks,
        config.block_size,
        pool_tokens,
        num_blocks * runner.bytes_per_block / 2**20,
        "target and draft model" if runner.draft else "model",
        str(runner.kv_cache_dtype).removeprefix("torch."),
    )
    return num_blocks
