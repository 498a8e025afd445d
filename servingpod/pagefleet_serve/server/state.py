"""What the server knows beyond the engine: admission (queue limit, draining), the
requests in flight, which a graceful drain waits for and finally cancels, and the one
worker thread where request bodies become token ids (off the event loop), shared between
clients in turn (`fair_queue`)."""

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from pagefleet_serve import metric_names as names
from pagefleet_serve.frontend.core_client import EngineCoreClient
from pagefleet_serve.frontend.generation_defaults import read_generation_defaults
from pagefleet_serve.frontend.images import MediaLimits, parse_limit_mm_per_prompt
from pagefleet_serve.frontend.vision import load_image_processing
from pagefleet_serve.reasoning import ReasoningParser, reasoning_parser
from pagefleet_serve.server.errors import APIError, unavailable
from pagefleet_serve.server.fair_queue import FairExecutor, current_client
from pagefleet_serve.server.metrics import ServerMetrics
from pagefleet_serve.server.settings import ServerSettings

logger = logging.getLogger(__name__)

# After the drain deadline, how long cancelled requests get to send their final event.
_CANCEL_GRACE_S = 5.0

T = TypeVar("T")


class Admission:
    """An admitted request's hold on the server: queue slots until its engine requests
    produce their first output, and a place among the requests a drain waits for (and
    finally cancels through `on_cancel`)."""

    def __init__(self, state: "ServerState", slots: int, on_cancel: Callable[[str], None]):
        self._state = state
        self.slots = slots
        self.cancel = on_cancel

    def release_slot(self) -> None:
        if self.slots:
            self.slots -= 1
            self._state.num_queued -= 1

    def close(self) -> None:
        """Give back every slot left and leave the in-flight set; idempotent."""
        while self.slots:
            self.release_slot()
        self._state.admissions.discard(self)


# Images a prompt may carry when --limit-mm-per-prompt leaves it to the model.
DEFAULT_MAX_IMAGES = 4


def media_limits(settings: ServerSettings, vision: bool) -> MediaLimits:
    """The image caps; ValueError for --limit-mm-per-prompt allowing a text-only model
    images."""
    limit = parse_limit_mm_per_prompt(settings.limit_mm_per_prompt)
    if limit and not vision:
        raise ValueError(
            f"limit_mm_per_prompt: model {settings.model_name} has no vision tower; it takes "
            "no images"
        )
    default = DEFAULT_MAX_IMAGES if vision else 0
    return MediaLimits(
        max_images=default if limit is None else limit,
        max_image_bytes=settings.max_image_bytes,
        max_image_pixels=settings.max_image_pixels,
        allowed_local_media_path=settings.allowed_local_media_path,
    )


class ServerState:
    def __init__(self, settings: ServerSettings, engine: EngineCoreClient) -> None:
        self.settings = settings
        self.engine = engine
        # A reasoning model's parser, the frontend's (it renders prompts and reads where
        # their thinking ends); ValueError when the one --reasoning-parser names cannot
        # read this model's tokenizer.
        engine.inputs.reasoning_parser = reasoning_parser(
            settings.reasoning_parser, engine.tokenizer
        )
        self.draining = False
        self.num_queued = 0
        self.admissions: set[Admission] = set()
        limit = settings.max_num_queued_requests
        self.max_num_queued = engine.default_max_num_queued if limit is None else limit
        # One thread: parsing, chat templates and tokenizers run there in turn (a fast
        # tokenizer must not be used by two threads at once), one job of each client's.
        self._frontend = FairExecutor("frontend")
        # What a request that leaves a sampling field out gets (ValueError: a bad config).
        self.sampling_defaults = read_generation_defaults(
            settings.generation_config, engine.config.model, settings.override_generation_config
        )
        if self.sampling_defaults:
            logger.info(
                "sampling defaults for requests that leave them out (--generation-config "
                "%s, --override-generation-config): %s",
                settings.generation_config,
                self.sampling_defaults,
            )
        # A vision-language model's image preprocessing (None: the model takes no images).
        self.image_processing = load_image_processing(engine.config.model, engine.tokenizer)
        self.media = media_limits(settings, self.image_processing is not None)
        self.metrics = ServerMetrics(
            settings.model_name,
            lambda: engine.stats,
            self._gauges,
            engine.startup_seconds,
            block_size=engine.config.block_size,
        )

    @property
    def ready(self) -> bool:
        return not self.draining and self.engine.is_healthy

    async def off_loop(self, work: Callable[[], T]) -> T:
        """Run `work` (CPU-bound work on request content) in the frontend thread, in the
        turn of the client whose request is being handled."""
        return await asyncio.wrap_future(self._frontend.submit(current_client(), work))

    def shutdown(self) -> None:
        self._frontend.shutdown()
        self.engine.shutdown()

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model (or no
        name); 404 for a name this server does not serve."""
        if name is None or name in self.settings.served_model_names:
            return None
        if name in self.engine.lora_adapters:  # the one check: the core only looks it up
            return name
        shown = name if len(name) <= 256 else f"{name[:256]}..."
        raise APIError(
            404, f"The model `{shown}` does not exist.", param="model", code="model_not_found"
        )

    def admit(self, wanted: int, on_cancel: Callable[[str], None]) -> Admission:
        """Take `wanted` queue slots for a validated request, or refuse it (503 draining or
        engine down, 429 queue full)."""
        if self.draining:
            self.metrics.reject("draining")
            raise unavailable(
                "the server is shutting down; retry on another replica", code="server_shutting_down"
            )
        # Only a core that is gone refuses work: one that is slow to answer (a stall that
        # turns /health to 503) may recover, and requests wait for it in its queue.
        if (reason := self.engine.dead_reason) is not None:
            self.metrics.reject("engine_unhealthy")
            raise unavailable(f"the engine is not healthy: {reason}", code="engine_unhealthy")
        limit = self.max_num_queued
        if self.num_queued + wanted > limit:
            self.metrics.reject("queue_full")
            raise APIError(
                429,
                f"the request queue is full ({self.num_queued} requests waiting, limit "
                f"{limit}); retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self.num_queued += wanted
        admission = Admission(self, wanted, on_cancel)
        self.admissions.add(admission)
        return admission

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, let those in flight finish for up to `timeout` seconds,
        then cancel the rest (they end with an error event) and wait for them to go."""
        self.draining = True
        loop = asyncio.get_running_loop()
        logger.info(
            "draining: %d requests in flight, waiting up to %.0fs", len(self.admissions), timeout
        )
        deadline = loop.time() + timeout
        while self.admissions and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.admissions:
            logger.warning("drain timeout: cancelling %d requests", len(self.admissions))
            for admission in list(self.admissions):
                admission.cancel("the server shut down before this request finished")
            deadline = loop.time() + _CANCEL_GRACE_S
            while self.admissions and loop.time() < deadline:
                await asyncio.sleep(0.05)
        logger.info("drain complete")

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        return self.engine.inputs.reasoning_parser

    def _gauges(self) -> dict[str, tuple[str, float]]:
        return {
            names.NUM_REQUESTS_QUEUED: (
                "Requests accepted by the server that have not produced a token yet.",
                self.num_queued,
            ),
            names.ENGINE_HEALTHY: (
                "1 while the engine loop is alive and stepping.",
                float(self.engine.is_healthy),
            ),
            names.DRAINING: ("1 once a graceful shutdown has begun.", float(self.draining)),
        }
