"""The server's own settings (the engine's live in EngineConfig)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # Requests accepted but not yet generating (waiting for a slot or in their first
    # prefill) beyond which new ones get 429. None: no limit.
    max_num_queued_requests: int | None = None
    # How long in-flight requests may run after SIGTERM before they are aborted.
    shutdown_timeout: float = 30.0
    # After a stream's first token, deltas arriving within this many seconds of the last
    # sent chunk are merged into one chunk (0: every engine step is its own chunk).
    stream_coalesce_interval: float = 0.0
    # An SSE comment is sent when a stream has been silent this long (queue, long prefill).
    sse_keepalive_interval: float = 5.0
    # OTLP/HTTP endpoint that receives a span per request (server/tracing.py); None: off.
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_names must be non-empty names")
        if self.max_num_queued_requests is not None and self.max_num_queued_requests < 0:
            raise ValueError(
                f"max_num_queued_requests must be >= 0, got {self.max_num_queued_requests}"
            )
        for name in ("shutdown_timeout", "stream_coalesce_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.sse_keepalive_interval <= 0:
            raise ValueError(
                f"sse_keepalive_interval must be > 0, got {self.sse_keepalive_interval}"
            )

    @property
    def model_name(self) -> str:
        """The name responses and metrics carry."""
        return self.served_model_names[0]
