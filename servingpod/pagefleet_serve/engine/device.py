"""Device policy of an engine: which device and dtype a config means, what the weight and
activation quantization become there, and how many bytes the KV cache may take.

Everything here is decided once, before a model is loaded, and handed to the runners as a
`RunnerConfig`; nothing reads it again at a step.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pagefleet_serve.config import EngineConfig

logger = logging.getLogger(__name__)

# The CPU budget is a fixed size, not a share of measured free memory.
CPU_DEFAULT_KV_BYTES = 1 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    return device


def make_current(device: torch.device) -> None:
    """Make `cuda:N` the current CUDA device: Triton launches its kernels on the current
    device, not on their tensors', and torch.cuda calls without a device read it too."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX-BF16 or AVX512-BF16), read
    from the Linux CPU flags; elsewhere bfloat16 is emulated and slower than float32."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    return bool(flags & {"amx_bf16", "avx512_bf16"})


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bfloat16 (as vLLM's CPU backend
    does), float32 on other CPUs."""
    if name == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


# CUDA devices whose float8 matmuls `quantization=auto` uses (Hopper and later).
FP8_MIN_CAPABILITY = (9, 0)


def weight_quantization(config: EngineConfig, device: torch.device) -> str:
    """The quantization the loader applies: the packed weight-only kernels are CPU ones, so
    on CUDA `auto` expands GGUF blocks (int8 is refused) and keeps float8 checkpoints in
    float8 (fp8) where their products are fast: one device (float8 weights are not split
    for tensor parallelism) of compute capability 9.0 or more (rowwise-scaled
    `torch._scaled_mm`); elsewhere it dequantizes them."""
    if device.type == "cpu" or config.quantization in ("none", "fp8"):
        return config.quantization
    if config.quantization == "int8":
        raise ValueError(f"quantization 'int8' runs on the CPU only, got device {device}")
    fast_fp8 = torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY
    return "fp8" if fast_fp8 and config.tensor_parallel_size == 1 else "none"


def activation_quantization(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> str:
    """The activation rounding of 4-bit matmuls: int8 is computed for float32 activations
    on the CPU (its integer dot products are the C++ CPU kernel's), and refused elsewhere."""
    if config.activation_quantization == "none":
        return "none"
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"activation_quantization {config.activation_quantization!r} runs on the CPU with "
            f"float32 activations (dtype float32), got device {device}, dtype "
            f"{str(dtype).removeprefix('torch.')}"
        )
    return config.activation_quantization


class DeviceMemory(Protocol):
    """What the KV budget reads of a device's memory (a fake one in tests)."""

    def reset_peak(self) -> None: ...
    def mem_get_info(self) -> tuple[int, int]: ...  # free, total bytes of the device
    def allocated(self) -> int: ...  # bytes torch holds now
    def peak_allocated(self) -> int: ...  # the most it held since reset_peak


@dataclass(frozen=True)
class CudaMemory:
    device: torch.device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        torch.cuda.empty_cache()  # what the warm-up freed is free for the KV cache
        return torch.cuda.mem_get_info(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


def kv_cache_budget(memory: DeviceMemory, utilization: float, warm_up: Callable[[], int]) -> int:
    """Bytes for the KV cache: `utilization` of the device, less what is in use after
    `warm_up` (the weights, the CUDA context, compiled kernels) and less its activation
    peak, held in reserve for the largest steps. `warm_up` runs them over a scratch KV
    cache, alive throughout the peak, and returns its bytes (as nano-vllm does)."""
    memory.reset_peak()
    scratch = warm_up()
    free, total = memory.mem_get_info()
    reserve = max(memory.peak_allocated() - memory.allocated() - scratch, 0)
    logger.info("warm-up: %.1f MiB of activations held in reserve", reserve / 2**20)
    return max(int(total * utilization) - (total - free) - reserve, 0)


def kv_cache_bytes(config: EngineConfig, device: torch.device, warm_up: Callable[[], int]) -> int:
    """The KV cache's bytes. On CUDA the warm-up runs first (its kernels compile before the
    engine is ready), and its activation peak is kept out of the budget. The CPU budget is
    a fixed size, not a share of measured free memory, so there is no peak to subtract,
    and the CPU kernels need no compiling: it skips the warm-up, which would only cost
    start-up time."""
    budget = CPU_DEFAULT_KV_BYTES
    if device.type == "cuda":
        budget = kv_cache_budget(CudaMemory(device), config.gpu_memory_utilization, warm_up)
    return budget if config.kv_cache_memory_bytes is None else config.kv_cache_memory_bytes


@dataclass(frozen=True)
class RunnerConfig:
    """The slice of an engine's configuration a model runner needs, resolved: the same for
    the target and the draft model."""

    device: torch.device
    dtype: torch.dtype
    block_size: int
    attention_backend: str
    kv_cache_dtype: str
    enforce_eager: bool = True
    activation_quantization: str = "none"
    weight_quantization: str = "none"  # what the loader applies
    # The seed of the generator the runner samples requests without a seed of their own
    # from (EngineConfig.seed, vLLM's --seed).
    seed: int = 0
    # LoRA adapter slots on the device and their rank (0: the runner serves no adapters).
    max_loras: int = 0
    max_lora_rank: int = 0

    @classmethod
    def of(cls, config: EngineConfig) -> "RunnerConfig":
        """Resolve `config`'s device policy (and make its CUDA device current)."""
        device = resolve_device(config.device)
        make_current(device)
        dtype = resolve_dtype(config.dtype, device)
        return cls(
            device=device,
            dtype=dtype,
            block_size=config.block_size,
            attention_backend=config.attention_backend,
            kv_cache_dtype=config.kv_cache_dtype,
            enforce_eager=config.enforce_eager,
            activation_quantization=activation_quantization(config, device, dtype),
            weight_quantization=weight_quantization(config, device),
            seed=config.seed,
            max_loras=config.max_loras if config.enable_lora else 0,
            max_lora_rank=config.max_lora_rank if config.enable_lora else 0,
        )
