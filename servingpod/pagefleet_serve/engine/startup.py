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
    # A hybrid model's state slots: the running sequences' (see engine.state_slots) and
    # the prefix cache's checkpoints (engine.state_checkpoints); 0 for other models.
    num_state_slots: int
    num_state_checkpoints: int
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
        if any(loaded.model.state_specs()):
            _check_hybrid(config, name)
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
        num_blocks, num_state_slots, num_checkpoints = _allocate_kv_cache(
            config, executor, max_model_len, phase
        )
        if device.type != "cuda":  # CUDA's warm-up ran before the KV cache was sized
            with phase("warm_up"):
                executor.warm_up_kernels(config.max_num_seqs)
    except BaseException:
        executor.close()
        raise
    return StartedModel(
        executor,
        name,
        model_config,
        pooling,
        max_model_len,
        num_blocks,
        num_state_slots,
        num_checkpoints,
        seconds,
    )


def _check_hybrid(config: EngineConfig, name: str) -> None:
    """What a hybrid model (recurrent layers with per-sequence state) is not served with:
    its state cannot be rolled back to a rejected draft, and adapters wrap attention
    projections its recurrent layers do not have."""
    refused = [
        (config.speculative_config is not None, "speculative_config (speculative decoding)"),
        (config.enable_lora, "enable_lora (LoRA adapters)"),
    ]
    for on, setting in refused:
        if on:
            raise ValueError(
                f"{name} is a hybrid model (recurrent layers keep a per-sequence state), "
                f"which is served without {setting}: drop it"
            )


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
) -> tuple[int, int, int]:
    """Size the KV cache pool (on CUDA after the warm-up, whose activation peak is kept out
    of it) and allocate it on every rank; its number of blocks, of state slots and of state
    checkpoints. With a draft model a block holds both models' K/V: the budget buys both at
    once. A hybrid model's state slots come first out of the same budget (see
    `state_slots_of`), with as many checkpoints when prefix caching is on."""
    started = time.monotonic()
    runner = executor.runner

    def warm_up() -> int:
        with phase("warm_up"):
            return executor.warm_up(
                config.max_num_batched_tokens, max_model_len, config.max_num_seqs
            )

    budget = kv_cache_bytes(config, runner.device, warm_up)
    per_slot = runner.state_bytes_per_slot * (2 if config.enable_prefix_caching else 1)
    num_state_slots = state_slots_of(
        budget, per_slot, config.max_num_seqs, attention=runner.bytes_per_block > 0
    )
    num_checkpoints = num_state_slots if config.enable_prefix_caching else 0
    budget -= num_state_slots * per_slot
    if runner.bytes_per_block:
        num_blocks = budget // runner.bytes_per_block
    else:  # no attention layer: blocks cost nothing, every running sequence fits whole
        num_blocks = config.max_num_seqs * -(-max_model_len // config.block_size)
    pool_tokens = num_blocks * config.block_size
    if max_model_len > pool_tokens:
        raise ValueError(
            f"max_model_len ({max_model_len} tokens) does not fit in the KV cache pool "
            f"({pool_tokens} tokens = {num_blocks} blocks of {config.block_size}); raise "
            f"kv_cache_memory_bytes or lower max_model_len"
        )
    executor.allocate_kv_cache(num_blocks, num_state_slots + num_checkpoints)
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
    if num_state_slots:
        logger.info(
            "state slots: %d + %d prefix checkpoints x %.1f KiB a sequence = %.1f MiB "
            "(recurrent layers' state)",
            num_state_slots,
            num_checkpoints,
            runner.state_bytes_per_slot / 2**10,
            num_state_slots * per_slot / 2**20,
        )
    return num_blocks, num_state_slots, num_checkpoints


def state_slots_of(
    budget: int, bytes_per_slot: int, max_num_seqs: int, attention: bool = True
) -> int:
    """A hybrid model's state slots: one per sequence of a full batch, or as many as half
    the budget holds (the rest is the attention layers' KV blocks; all of it for a model
    without `attention`), at `bytes_per_slot` each (a checkpoint's included); 0 for a model
    without recurrent layers. ValueError when the budget holds none."""
    if not bytes_per_slot:
        return 0
    share = budget // 2 if attention else budget
    slots = min(max_num_seqs, share // bytes_per_slot)
    if slots < 1:
        raise ValueError(
            f"kv_cache_memory_bytes ({budget}) holds no state slot: a sequence's recurrent "
            f"state takes {bytes_per_slot} bytes ({'half ' if attention else ''}the budget "
            f"goes to state slots at most); raise kv_cache_memory_bytes"
        )
    return slots
