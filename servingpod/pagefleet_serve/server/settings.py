"""The server's own settings (the engine's live in EngineConfig)."""

from dataclasses import dataclass

from pagefleet_serve.reasoning import REASONING_PARSERS
from pagefleet_serve.server.tool_parsers import TOOL_CALL_PARSERS

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # Requests accepted but not yet generating (waiting for a slot or in their first
    # prefill) beyond which new ones get 429. None: the number of KV cache blocks (each
    # request needs one at least), no fewer than max_num_seqs (`ServerState`).
    max_num_queued_requests: int | None = None
    # How long in-flight requests may run after SIGTERM before they are aborted.
    shutdown_timeout: float = 30.0
    # After a stream's first token, deltas arriving within this many seconds of the last
    # sent chunk are merged into one chunk (0: every engine step is its own chunk).
    stream_coalesce_interval: float = 0.0
    # An SSE comment is sent when a stream has been silent this long (queue, long prefill),
    # for proxies with idle timeouts. 0: never (the default): some SSE readers, vLLM's
    # benchmark client among them, lose the event that follows a comment.
    sse_keepalive_interval: float = 0.0
    # A stream whose client takes no bytes for this many seconds (its socket's buffers are
    # full: it connected and stopped reading) is aborted, its request with it, so that
    # nobody's unread output piles up in the server. 0: never.
    stream_write_timeout: float = 60.0
    # Request bodies above this get 413, checked while the body is read.
    max_request_body_bytes: int = 4 * 2**20
    # A connection must send a request's headers, then its body, within these many seconds
    # of being ready for them, or it is closed (a slow or stalled client holds no slot).
    header_read_timeout: float = 10.0
    body_read_timeout: float = 30.0
    # Requests in flight (headers received, response not finished) beyond which new ones
    # get 503; idle connections and the probes (/health, /ready, /metrics) do not count.
    limit_concurrency: int = 1024
    # Connections one client address may hold open; more are closed at once. None: no cap
    # (the default: behind the router or a load balancer every client shares one address).
    max_connections_per_client: int | None = None
    # Refusals (4xx answers) one client may get a second, in bursts of two seconds' worth;
    # past them each refusal is answered `refusal_delay` seconds late (0: never), so that
    # a client looping on faulty requests cannot take the API process from the others
    # (server/refusals.py). Accepted requests are never delayed.
    refusals_per_second: float = 20.0
    refusal_delay: float = 1.0
    # Peers whose X-Forwarded-For names the client (uvicorn's --forwarded-allow-ips: a
    # comma-separated list of addresses or networks, "*" for any): behind the router,
    # which appends it, fairness between clients and the access log see the real client.
    forwarded_allow_ips: str = "127.0.0.1"
    # fcfs: requests run in arrival order and `priority` is refused; priority: lower
    # `priority` values run first (vLLM's --scheduling-policy).
    scheduling_policy: str = "fcfs"
    # /docs, /redoc and /openapi.json; None: served only when no API key is set.
    serve_docs: bool | None = None
    # OTLP/HTTP endpoint that receives a span per request (server/tracing.py); None: off.
    otlp_traces_endpoint: str | None = None
    # tool_choice "auto": the model's text is parsed for tool calls in this format (vLLM's
    # --enable-auto-tool-choice and --tool-call-parser).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # How a reasoning model's thinking is split from its answer (vLLM's
    # --reasoning-parser); None: the parser of the model's family, if it has one
    # (`reasoning.reasoning_parser`); "none": no split.
    reasoning_parser: str | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter are served (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING); off, the adapters are those of --lora-modules.
    allow_runtime_lora_updating: bool = False
    # The directory under which POST /v1/load_lora_adapter reads local paths (symlinks
    # followed); None: no local path loads at run time (hf:// does).
    allowed_lora_root: str | None = None
    # /v1/responses keeps this many recent responses (least recently used out first) for
    # `previous_response_id`, each for at most this many seconds; 0 entries: none kept.
    responses_store_max_entries: int = 1024
    responses_store_max_age: float = 3600.0
    # Where a request's left-out temperature, top_p, top_k, min_p and repetition_penalty
    # come from (vLLM's --generation-config: auto, vllm or a directory), and JSON text
    # that adds to or replaces them (frontend/generation_defaults.py).
    generation_config: str = "auto"
    override_generation_config: str | None = None
    # Images one prompt may carry (vLLM's --limit-mm-per-prompt JSON, {"image": N});
    # None: 0 for a text-only model, DEFAULT_MAX_IMAGES for one with a vision tower.
    limit_mm_per_prompt: str | None = None
    # The directory image_url's file:// URLs may name (vLLM's flag); None: data: URLs only.
    allowed_local_media_path: str | None = None
    # An image's encoded bytes and its width x height (read from its header before any
    # pixel is decoded) beyond which it is refused.
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_names must be non-empty names")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty; leave it unset to serve without a key")
        if self.max_num_queued_requests is not None and self.max_num_queued_requests < 0:
            raise ValueError(
                f"max_num_queued_requests must be >= 0, got {self.max_num_queued_requests}"
            )
        for name in (
            "shutdown_timeout",
            "stream_coalesce_interval",
            "sse_keepalive_interval",
            "stream_write_timeout",
            "refusal_delay",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "header_read_timeout",
            "body_read_timeout",
            "max_request_body_bytes",
            "limit_concurrency",
            "refusals_per_second",
            "max_image_bytes",
            "max_image_pixels",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.responses_store_max_entries < 0:
            raise ValueError(
                f"responses_store_max_entries must be >= 0, got {self.responses_store_max_entries}"
            )
        if self.responses_store_max_age <= 0:
            raise ValueError(
                f"responses_store_max_age must be > 0, got {self.responses_store_max_age}"
            )
        if self.max_connections_per_client is not None and self.max_connections_per_client <= 0:
            raise ValueError(
                f"max_connections_per_client must be > 0, got {self.max_connections_per_client}"
            )
        if not self.forwarded_allow_ips.strip():
            raise ValueError("forwarded_allow_ips must name at least one address, or '*'")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {tuple(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        known_reasoning = (*REASONING_PARSERS, "none")
        if self.reasoning_parser is not None and self.reasoning_parser not in known_reasoning:
            raise ValueError(
                f"reasoning_parser must be one of {known_reasoning}, got {self.reasoning_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )

    @property
    def model_name(self) -> str:
        """The name responses and metrics carry."""
        return self.served_model_names[0]

    @property
    def docs_enabled(self) -> bool:
        return self.api_key is None if self.serve_docs is None else self.serve_docs
