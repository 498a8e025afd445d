"""The serving pod's vocabulary and the engine's one configuration object, validated once
at construction.

Torch-free, and the one place that names what the engine accepts: dtypes, KV cache dtypes,
the byte-size grammar, the architectures served, speculative decoding's settings. The CLI's
`choices=`, the operator's spec checks, the CRD test and the kernels' tables (checked
against these by tests) read them from here.
"""

import json
import re
from dataclasses import dataclass, fields

from pagefleet_serve.model_uri import ModelURIError, parse_model_uri

BUILTIN_MODEL = "builtin://smollm2-135m"
# auto: bfloat16 on CUDA and on CPUs with native bf16, else float32.
DTYPES = ("auto", "float32", "float16", "bfloat16")
# auto: the model's dtype; fp8 is float8 e4m3 (pagefleet_kernels.kv_cache maps them to torch).
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
# The model_types of Hugging Face directories the loader reads (config.json), and the
# llama.cpp architectures of the GGUF files it reads (Mistral's GGUFs are `llama` files).
# Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE and gpt-oss are mixtures of experts; LFM2, LFM2-MoE,
# Mamba2, Granite 4.0-H, Nemotron-H, Qwen3-Next and Qwen3.5 are hybrids (recurrent layers
# beside attention).
HF_MODEL_TYPES = (
    "gemma2",
    "gemma3",
    "gemma3_text",
    "gpt_oss",
    "granitemoehybrid",
    "lfm2",
    "lfm2_moe",
    "llama",
    "mamba2",
    "mistral",
    "mixtral",
    "nemotron_h",
    "olmoe",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_moe",
    "qwen3_next",
)
GGUF_ARCHITECTURE_NAMES = (
    "gemma2",
    "gemma3",
    "llama",
    "phi3",
    "qwen2",
    "qwen2moe",
    "qwen3",
    "qwen3moe",
)
# What the engine serves (vLLM's --task): generate samples tokens; embed prefills each
# request and pools its final hidden states into one vector (no sampling, no decode, no KV
# kept past the request); auto is embed for an embedding checkpoint (a sentence-transformers
# layout: modules.json naming a Pooling module), else generate.
TASKS = ("auto", "generate", "embed")
# How an embed model pools a prompt's final hidden states: the last token's, the mean over
# every token, or the first token's (cls).
POOLING_METHODS = ("last", "mean", "cls")
# auto: triton on CUDA, the C++ kernel (cpu) on the CPU when it builds, else torch
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
# Weights (vLLM's --quantization): auto keeps a GGUF's own Q4_0/Q4_1/Q8_0 blocks on the CPU,
# none expands them to the model dtype, int8 is weight-only int8 with a scale per row (CPU).
# Default none: PyTorch 2.13's weight-only CPU kernels are fast with bfloat16 activations
# only (int4 at batch 1: 65 us vs 137 us for the float32 matmul of a 3072x576 matrix) and
# take a slow path with float32 ones, which `dtype=auto` picks on CPUs without bf16. Float32
# rows go to the C++ backend's own int4 matmul instead (faster than the float32 matrix up
# to ~8 rows), but wide float32 batches dequantize each layer's weight on every step and
# stay slower than expanded weights.
# fp8 keeps a float8 checkpoint's weights (scaled per tensor or per output channel) in
# float8 and multiplies them with torch._scaled_mm, activations scaled per token; auto does
# so on CUDA. On the CPU that product is slow (about 4 ms for a 1536 x 576 matrix at one
# row), so auto dequantizes float8 checkpoints there.
QUANTIZATIONS = ("auto", "none", "int8", "fp8")
# none: 4-bit matmuls take the activations as they are; int8: rounded to int8 per 32 inputs
# first (llama.cpp's arithmetic), multiplied with integer dot products on the CPU.
ACTIVATION_QUANTIZATIONS = ("none", "int8")
# The byte-size grammar of `--kv-cache-memory`. The operator checks spec.engine.kvCacheMemory
# with it too, and the CRD's pattern is the same word for word (tests/operator ties them
# together), so that whatever the API server admits the pod can read.
BYTE_SIZE_PATTERN = r"^[0-9]+(\.[0-9]+)?([KMGT]i?B)?$"
BYTE_UNITS = {
    "": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
}


def parse_bytes(text: str | int) -> int:
    """'2GiB' / '512MB' / '1000000' -> bytes (decimal units: KB, MB, GB, TB; binary: KiB..TiB)."""
    if isinstance(text, int):
        return text
    text = str(text).strip()
    match = re.match(BYTE_SIZE_PATTERN, text)
    if not match:
        raise ValueError(
            f"cannot read {text!r} as a size in bytes: a number with an optional unit "
            f"({', '.join(unit for unit in BYTE_UNITS if unit)}), e.g. 2GiB, 512MB, 1000000"
        )
    unit = match.group(2) or ""
    return int(float(text[: len(text) - len(unit)]) * BYTE_UNITS[unit])


# --speculative-config: vLLM's JSON keys, validated once into a frozen dataclass.
SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    # draft_model: the draft's URI (any form the loader reads); it must share the target's
    # vocabulary, and runs in the target's dtype, quantization and KV cache dtype.
    model: str | None = None
    # n-gram prompt lookup: the longest and shortest suffix of the sequence looked up.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # No proposals in a step whose decoding batch is larger than this: verifying drafts
    # turns each decode row into a query span, which costs more than it saves once the
    # step is compute-bound rather than weight-reading-bound. None: always propose.
    disable_by_batch_size: int | None = 4

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}"
            )
        self._check_model()
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"speculative_config.{name} must be a positive integer, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be at "
                f"most prompt_lookup_max ({self.prompt_lookup_max})"
            )
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be a positive integer or null, "
                f"got {size!r}"
            )

    def _check_model(self) -> None:
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError(
                    "speculative_config.model names a draft model, which method 'ngram' does "
                    "not use; drop it or set method to 'draft_model'"
                )
            return
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                "speculative_config.model is required by method 'draft_model': the draft "
                f"model's URI, got {self.model!r}"
            )
        try:
            parse_model_uri(self.model)
        except ModelURIError as exc:
            raise ValueError(f"speculative_config.model: {exc}") from exc

    @classmethod
    def from_json(cls, text: str | dict | None) -> "SpeculativeConfig | None":
        """Parse the flag's JSON (a dict is taken as already parsed); None or {} is off."""
        if text is None or isinstance(text, cls):
            return text
        text = json_flag_object(text, "speculative_config")
        if not text:
            return None
        if "model" in text and "method" not in text:  # vLLM's short form of a draft model
            text = {"method": "draft_model", **text}
        check_known_keys(cls, text, "speculative_config")
        return cls(**text)


def json_flag_object(text: str | dict, name: str) -> dict:
    """A flag's JSON object (a dict is taken as already parsed; empty text is {})."""
    if isinstance(text, str):
        try:
            text = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(text, dict):
        raise ValueError(f"{name} must be a JSON object, got {text!r}")
    return text


def check_known_keys(cls: type, data: dict, name: str) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; allowed: {sorted(known)}")


# --kv-events-config: vLLM's JSON keys. A ZMQ endpoint with a wildcard host (tcp://*:5557)
# or an ipc:// path is bound; any other is connected to (an indexer that binds and
# collects from many pods, as llm-d's does).
KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # a ROUTER socket answering replay requests
    buffer_steps: int = 10_000  # the batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark, in messages
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in KV_EVENT_PUBLISHERS:
            raise ValueError(
                f"kv_events_config.publisher must be one of {KV_EVENT_PUBLISHERS}, "
                f"got {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"kv_events_config.{name} must be a positive integer, got {value!r}"
                )
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not re.match(r"^(tcp|ipc|inproc)://.+", str(value)):
                raise ValueError(
                    f"kv_events_config.{name} must be a ZMQ endpoint (tcp://host:port, "
                    f"tcp://*:port, ipc://path), got {value!r}"
                )

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: "str | dict | KVEventsConfig | None") -> "KVEventsConfig | None":
        """Parse the flag's JSON (a dict is taken as already parsed); None, {} or events
        not enabled is off."""
        if text is None or isinstance(text, cls):
            return text if text is None or text.enabled else None
        text = json_flag_object(text, "kv_events_config")
        check_known_keys(cls, text, "kv_events_config")
        config = cls(**text)
        return config if config.enabled else None


# --lora-modules: vLLM's `name=path` pairs (or its JSON objects {"name", "path"}).
# An adapter's name is a Prometheus label value and a /v1/models id: bounded as a DNS label
# is (the CRD's adapter names are too).
MAX_LORA_NAME_CHARS = 63
LORA_NAME_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_LORA_NAME_CHARS - 1}}}$"
LORA_NAME_RULE = (
    f"must be at most {MAX_LORA_NAME_CHARS} letters, digits, '.', '_' or '-', starting with "
    "a letter or digit"
)


def is_lora_name(name: object) -> bool:
    return isinstance(name, str) and re.fullmatch(LORA_NAME_PATTERN, name) is not None


@dataclass(frozen=True)
class LoRAModule:
    """A LoRA adapter served from start-up: the name requests give as `model`, and where its
    PEFT files (adapter_config.json, adapter_model.safetensors) are: a local path, file://,
    pvc:// or hf://org/name[@revision]."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if not is_lora_name(self.name):
            shown = self.name if len(str(self.name)) <= 80 else f"{str(self.name)[:80]}..."
            raise ValueError(f"lora_modules: adapter name {shown!r} {LORA_NAME_RULE}")
        try:
            parse_model_uri(self.path)
        except ModelURIError as exc:
            raise ValueError(f"lora_modules: adapter {self.name!r}: {exc}") from exc

    @classmethod
    def parse(cls, item: "str | dict | LoRAModule") -> "LoRAModule":
        """`name=path`, a JSON object {"name": ..., "path": ...} (vLLM's two forms), or a
        LoRAModule."""
        if isinstance(item, cls):
            return item
        if isinstance(item, str) and item.lstrip().startswith("{"):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as exc:
                raise ValueError(f"lora_modules: {item!r} is not valid JSON: {exc}") from exc
        if isinstance(item, dict):
            if set(item) - {"name", "path", "base_model_name"} or not {"name", "path"} <= set(item):
                raise ValueError(f"lora_modules: {item!r} needs exactly the keys name and path")
            return cls(item["name"], item["path"])
        if not isinstance(item, str) or "=" not in item:
            raise ValueError(f"lora_modules: {item!r} is not name=path")
        name, _, path = item.partition("=")
        return cls(name.strip(), path.strip())


@dataclass(frozen=True)
class PoolingConfig:
    """How an embed model turns a prompt into one vector: `method` (POOLING_METHODS), then
    L2 normalisation or not; `dimensions` of the vector (the hidden size), and the smaller
    ones it may be cut to (Matryoshka, when the checkpoint declares it: None, any up to
    `dimensions` when it names none)."""

    method: str = "last"
    normalize: bool = True
    dimensions: int = 0
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(
                f"pooling method must be one of {POOLING_METHODS}, got {self.method!r}"
            )

    def check_dimensions(self, wanted: int) -> None:
        """ValueError naming `dimensions` when a vector cannot be cut to `wanted`."""
        if not self.matryoshka:
            raise ValueError(
                "dimensions: this model does not support Matryoshka embeddings (its "
                "checkpoint declares none); leave dimensions out"
            )
        allowed = self.matryoshka_dimensions
        if wanted == self.dimensions:  # the whole vector
            return
        if not 1 <= wanted <= self.dimensions or (allowed and wanted not in allowed):
            which = list(allowed) if allowed else f"1 to {self.dimensions}"
            raise ValueError(f"dimensions: must be one of {which}, got {wanted}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = BUILTIN_MODEL
    dtype: str = "auto"  # one of DTYPES
    device: str = "auto"  # auto: cuda when available, else cpu
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length (capped by the pool)
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU, gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    quantization: str = "none"
    # int8: the activations of 4-bit matmuls rounded to int8 per 32 inputs (llama.cpp's
    # arithmetic), multiplied with integer dot products; needs quantization "auto".
    activation_quantization: str = "none"
    # vLLM's --enforce-eager: True runs every op eagerly; False compiles each layer's work
    # around its attention with torch.compile (inductor), paid for by the first steps.
    enforce_eager: bool = True
    # vLLM's --seed: the sampler's generator for requests without a seed of their own
    # starts from it, so that a run repeats with the same requests in the same order.
    seed: int = 0
    # vLLM's --speculative-config: a SpeculativeConfig, its JSON text or dict; None: off.
    speculative_config: SpeculativeConfig | str | dict | None = None
    # vLLM's --kv-events-config: KV cache events over ZMQ; None (or not enabled): none.
    kv_events_config: KVEventsConfig | str | dict | None = None
    # The KV tier below the prefix cache (engine/kv_tier.py): vLLM's --kv-offloading-size,
    # GiB of host memory for blocks the device computed (None: none); a directory of block
    # files that outlives the process and may be shared by several pods (None: none),
    # kept under kv_offload_dir_max_size GiB.
    kv_offloading_size: float | None = None
    kv_offload_dir: str | None = None
    kv_offload_dir_max_size: float = 10.0
    # Seconds a structured output's grammar may take to compile before its request fails.
    structured_outputs_compile_timeout: float = 30.0
    # vLLM's --enable-lora: requests may name a LoRA adapter as their model; each row of a
    # step carries its own adapter or none. The layers then run eagerly (enforce_eager).
    enable_lora: bool = False
    # vLLM's --lora-modules: adapters loaded at start-up (LoRAModule, or its `name=path`).
    lora_modules: tuple[LoRAModule, ...] = ()
    # vLLM's --max-loras: adapters resident in the device's slots at once (a step's rows
    # read at most this many); the others wait in host memory until a slot frees.
    max_loras: int = 1
    # vLLM's --max-lora-rank: the slots' rank; an adapter of a higher rank is refused.
    max_lora_rank: int = 16
    # vLLM's --max-cpu-loras: adapters kept in host memory at once (at least max_loras: the
    # device's are among them); the others are read again from their path when a request
    # names one. None: max_loras (vLLM's default).
    max_cpu_loras: int | None = None
    # Adapters served by name at once (each a /v1/models entry and a metric label); a load
    # past it is refused until one is unloaded.
    max_lora_adapters: int = 1024
    # Seconds an adapter's files may take to be read (a load, or a read back into host
    # memory) before the read fails: storage that hangs fails its adapter, not the pod.
    lora_read_timeout: float = 60.0
    # vLLM's --task: one of TASKS (auto: detected from the model's files).
    task: str = "auto"
    # vLLM's --tensor-parallel-size: ranks the model is split over (engine/executor/), one
    # per GPU, on the CPU one per group of the core's CPUs; --pipeline-parallel-size: stages
    # of layers, one after the other, each of tensor_parallel_size ranks.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # The ranks' rendezvous (torch.distributed's TCP store, on rank 0's node) and, across
    # nodes, vLLM's --nnodes / --node-rank: the world_size ranks split evenly over the
    # nodes, node 0 holding rank 0 (the scheduler); master_port None: a free one
    # (one node only: the other nodes must know it).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.from_json(self.speculative_config)
        )
        object.__setattr__(
            self, "kv_events_config", KVEventsConfig.from_json(self.kv_events_config)
        )
        object.__setattr__(
            self, "lora_modules", tuple(LoRAModule.parse(m) for m in self.lora_modules or ())
        )

        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "kv_cache_memory_bytes",
            "max_loras",
            "max_lora_rank",
            "max_cpu_loras",
            "max_lora_adapters",
        ):
            positive(name)
        if not self.lora_read_timeout > 0:
            raise ValueError(f"lora_read_timeout must be > 0 seconds, got {self.lora_read_timeout}")
        self._check_lora()
        self._check_parallel()
        self._check_kv_tier()
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.activation_quantization not in ACTIVATION_QUANTIZATIONS:
            raise ValueError(
                f"activation_quantization must be one of {ACTIVATION_QUANTIZATIONS}, "
                f"got {self.activation_quantization!r}"
            )
        if self.activation_quantization != "none" and self.quantization != "auto":
            raise ValueError(
                f"activation_quantization {self.activation_quantization!r} rounds the "
                "activations of 4-bit weights, which quantization 'auto' keeps (a GGUF's "
                f"Q4_0/Q4_1/Q8_0); got quantization {self.quantization!r}"
            )
        if not self.structured_outputs_compile_timeout > 0:
            raise ValueError(
                "structured_outputs_compile_timeout must be a positive number of seconds, "
                f"got {self.structured_outputs_compile_timeout!r}"
            )
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.task == "embed" and self.speculative_config is not None:
            raise ValueError(
                "speculative_config drafts tokens to decode, which task 'embed' never does"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )

    @property
    def world_size(self) -> int:
        """Every rank of every pipeline stage (global rank = stage * tensor size + rank)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each node (node r holds ranks r*k .. r*k+k-1: a stage's ranks stay
        on one node where the nodes hold whole stages)."""
        return self.world_size // self.nnodes

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                f"{self.pipeline_parallel_size} ranks must split evenly over nnodes "
                f"{self.nnodes} (the same number of ranks on every node)"
            )
        rank = self.node_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes {self.nnodes}), got {rank!r}")
        port = self.master_port
        if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"master_port must be a port number (1-65535), got {port!r}")
        if self.nnodes > 1 and port is None:
            raise ValueError(
                f"nnodes {self.nnodes} needs master_port: every node joins rank 0's node there"
            )
        # A rank's step is its layers' ops between collectives: no adapters' deltas (their
        # slots are not split), no compiled graphs around them, no pooled embeddings yet.
        for size, name in (
            (self.tensor_parallel_size, "tensor_parallel_size"),
            (self.pipeline_parallel_size, "pipeline_parallel_size"),
        ):
            for unsupported, flag in (
                (size > 1 and self.enable_lora, "enable_lora"),
                (size > 1 and not self.enforce_eager, "enforce_eager off (torch.compile)"),
                (size > 1 and self.task == "embed", "task 'embed'"),
            ):
                if unsupported:
                    raise ValueError(
                        f"{name} {size} does not support {flag} yet: use {name} 1 or drop it"
                    )

    @property
    def kv_tier_enabled(self) -> bool:
        return self.kv_offloading_size is not None or self.kv_offload_dir is not None

    def _check_kv_tier(self) -> None:
        for name in ("kv_offloading_size", "kv_offload_dir_max_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"{name} must be a positive number of GiB, got {value!r}")
        if self.kv_offload_dir == "":
            raise ValueError("kv_offload_dir must be a directory path, got ''")
        if not self.kv_tier_enabled:
            return
        spec = self.speculative_config
        for unsupported, setting in (
            (not self.enable_prefix_caching, "enable_prefix_caching off"),
            (self.world_size > 1, "tensor_parallel_size or pipeline_parallel_size over 1"),
            (spec is not None and spec.method == "draft_model", "a draft model"),
            (self.task == "embed", "task 'embed'"),
        ):
            if unsupported:
                raise ValueError(
                    f"the KV tier (kv_offloading_size, kv_offload_dir) keeps prefix-cache "
                    f"blocks, which {setting} does not support yet: drop one of them"
                )

    def _check_lora(self) -> None:
        names = [module.name for module in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules: adapter names must be unique, got {names}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules names adapters, which need enable_lora")
        if len(names) > self.max_lora_adapters:
            raise ValueError(
                f"lora_modules names {len(names)} adapters, more than max_lora_adapters "
                f"({self.max_lora_adapters})"
            )
        if self.enable_lora and not self.enforce_eager:
            raise ValueError(
                "enable_lora runs the layers op by op, which torch.compile does not cover: "
                "set enforce_eager (the default) or drop enable_lora"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras}): the adapters in the device's slots are kept in host "
                "memory too"
            )
