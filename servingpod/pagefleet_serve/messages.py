"""What the frontend (the API side) and the engine core say to each other: plain
dataclasses carrying token ids only, never text, pickled over a local pipe or handed over
in one process. Torch-free, at the bottom of the layers: both sides import it, neither
side's module defines it.

Requests travel whole (`Request`, with its `SamplingParams` dataclass), so a field added to
either reaches the core without a change here. `PROTOCOL_VERSION` is checked once, in the
core's `CoreReady`; bump it when a message changes shape.
"""

from dataclasses import dataclass, field

from pagefleet_serve.config import PoolingConfig
from pagefleet_serve.outputs import RequestOutput
from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.structured.constraint import StructuredOutputs

PROTOCOL_VERSION = 11


# -- the data both sides share ---------------------------------------------------------------
@dataclass(frozen=True)
class ImageInput:
    """An image of a prompt, preprocessed by the frontend: its pixels (float32, C order,
    `shape` as the family's vision tower takes them), the SHA-256 of its encoded bytes
    (what the prefix cache and the encoder cache know it by), and the `length` prompt
    tokens from `offset` that its embeddings replace."""

    digest: str
    offset: int
    length: int
    pixels: bytes
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Request:
    """A validated request (the frontend's `InputProcessor` made it; the core trusts it)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    # The LoRA adapter it runs with, by the name the core knows it by; None: the base model.
    lora_name: str | None = None
    # True: an embedding request (an embed engine's only kind): prefilled, pooled, done;
    # its output carries `embedding` and no tokens.
    pooling: bool = False
    # Who sent it (the server: the peer's address; "" offline): the scheduler shares the
    # batch's seats between clients (see engine/scheduler.py).
    client: str = ""
    # A vision-language model's images, in prompt order.
    images: tuple[ImageInput, ...] = ()


@dataclass(frozen=True)
class LoRAAdapterInfo:
    """An adapter the core serves: its name (what requests give as `model`) and where it
    was loaded from."""

    name: str
    path: str


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against; the frontend gets them from the core."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int


@dataclass(frozen=True)
class SpecDecodeStats:
    num_drafts: int = 0  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # [i]: drafts whose token i was accepted


@dataclass(frozen=True)
class EncoderStats:
    """A vision-language model's encoder: images asked of its cache (by hash), those it
    held, and the seconds the tower and projector ran for the others."""

    queries: int
    hits: int
    seconds: float


@dataclass(frozen=True)
class StateStats:
    """A hybrid model's state slots (see engine/state_slots.py): the running sequences'
    and those in use, the prefix cache's checkpoints and those holding a state, and what
    one sequence's state costs."""

    num_slots: int
    num_used_slots: int
    num_checkpoints: int
    num_saved_checkpoints: int
    bytes_per_sequence: int


@dataclass(frozen=True)
class LoRAStats:
    """The adapters of the running and the waiting requests (names, sorted), and how many
    the device holds at once; the adapters resident now, in use or idle: in the device's
    slots, and in host memory only (at most max_cpu_loras, max_loras by default)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    max_loras: int
    on_device: tuple[str, ...] = ()
    in_host_memory: tuple[str, ...] = ()


@dataclass(frozen=True)
class KVTierStats:
    """The KV tier below the prefix cache (engine/kv_tier.py), by medium: CPU (host
    memory) and STORAGE (files). Tokens looked up there and found, bytes loaded into the
    device and copied out of it, bytes held now, and the file writer's queue, dropped
    writes, refused writes and invalid files (truncated, corrupted, foreign: recomputed)."""

    query_tokens: int
    cpu_hit_tokens: int
    storage_hit_tokens: int
    cpu_bytes_loaded: int
    storage_bytes_loaded: int
    cpu_bytes_stored: int
    storage_bytes_written: int
    cpu_stored_bytes: int
    storage_stored_bytes: int
    storage_queue_depth: int
    storage_dropped_writes: int
    storage_write_errors: int
    storage_invalid_blocks: int

    @property
    def hit_tokens(self) -> int:
        return self.cpu_hit_tokens + self.storage_hit_tokens


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_used_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_kv_tokens: int  # tokens whose K/V the running sequences hold in their blocks
    spec_decode: SpecDecodeStats = SpecDecodeStats()
    lora: LoRAStats | None = None  # None: the engine serves no adapters
    state: StateStats | None = None  # None: the model keeps no per-sequence state
    kv_events_dropped: int | None = None  # None: no KV events published
    encoder: EncoderStats | None = None  # None: the model takes no images
    kv_tier: KVTierStats | None = None  # None: no KV tier (--kv-offloading-size/-dir)


# -- frontend -> core ------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request: Request


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    reason: str = "abort"  # "stop": the frontend found a stop string
    sample_index: int | None = None  # None: every sample of the request


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class LoadLoRAAdapter:
    """Read a LoRA adapter and serve it as `lora_name` (answered by `LoRAAdaptersChanged`
    with the same `op_id`)."""

    op_id: str
    lora_name: str
    lora_path: str
    # A client's load (POST /v1/load_lora_adapter): a local path must lie under
    # `allowed_root`, and a file that cannot be read is answered without the server's paths.
    from_client: bool = False
    allowed_root: str | None = None


@dataclass(frozen=True)
class UnloadLoRAAdapter:
    op_id: str
    lora_name: str


@dataclass(frozen=True)
class CompileConstraint:
    """Compile a structured output's constraint before the request that needs it is sent
    (answered by `ConstraintCompiled` with the same `op_id`): a constraint that cannot be
    compiled is then refused before the request starts. `client`: who waits for it (the
    compile queue's budget is per client); None: a caller that is always served."""

    op_id: str
    constraint: StructuredOutputs
    client: str | None


@dataclass(frozen=True)
class CancelCompile:
    """The caller of a `CompileConstraint` stops waiting for it (its client left); a
    compile nobody waits for any more is dropped."""

    op_id: str


# -- core -> frontend ------------------------------------------------------------------------
@dataclass(frozen=True)
class CoreReady:
    """What a frontend needs to know of the engine a core runs (the core builds it)."""

    version: int
    model_name: str
    limits: RequestLimits
    num_blocks: int
    stats: EngineStats
    # The core's start-up phases in seconds (imports, download, kernel_load, weight_load,
    # kv_cache, warm_up), exported as pagefleet:startup_seconds{phase}.
    startup_seconds: dict[str, float] = field(default_factory=dict)
    # The LoRA adapters it serves, and whether it can serve any (enable_lora).
    lora_adapters: tuple[LoRAAdapterInfo, ...] = ()
    lora_enabled: bool = False
    # How an embed engine pools (its task is embed); None: it generates.
    pooling: PoolingConfig | None = None


@dataclass(frozen=True)
class LoRAAdaptersChanged:
    """The answer to a LoadLoRAAdapter / UnloadLoRAAdapter: `error` None on success, else
    why, with the HTTP status that says whose fault it is (400, 404 unknown adapter, 409
    busy); `adapters` what the core serves now either way."""

    op_id: str
    adapters: tuple[LoRAAdapterInfo, ...]
    error: str | None = None
    status: int = 200


@dataclass(frozen=True)
class ConstraintCompiled:
    """The answer to a `CompileConstraint`: `error` None when the grammar is compiled (and
    cached for the request that follows), else why not, with the HTTP status that says
    whose fault it is (400 the constraint's, 429 the compile queue or this client's share
    of it is full, 500 the engine's)."""

    op_id: str
    error: str | None = None
    status: int = 200


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[RequestOutput]  # token ids; the frontend adds the text
    stats: EngineStats | None  # None: they could not be read this time


@dataclass(frozen=True)
class RequestRejected:
    request_id: str
    error: str
    invalid: bool  # True: the request itself was at fault (a ValueError)


@dataclass(frozen=True)
class Heartbeat:
    step_running_s: float | None  # how long the current step has run; None: between steps


@dataclass(frozen=True)
class CoreFailed:
    """The core cannot go on (or could not start); every request has been failed."""

    reason: str
