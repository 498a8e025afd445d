"""What the frontend (the API process) and the engine core say to each other: plain
dataclasses carrying token ids only, never text, pickled over a local pipe.

Requests travel whole (`Request`, with its `SamplingParams` dataclass), so a field added to
either reaches the core without a change here. `PROTOCOL_VERSION` is checked once, in the
core's `CoreReady`; bump it when a message changes shape.
"""

from dataclasses import dataclass

from pagefleet_serve.engine.llm_engine import EngineStats, LLMEngine, Request
from pagefleet_serve.outputs import RequestOutput

PROTOCOL_VERSION = 2


# -- frontend -> core ------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request: Request  # validated by the frontend (`validate_request`)


@dataclass(frozen=True)
class AbortRequest:
    request_id: str
    reason: str = "abort"  # "stop": the frontend found a stop string
    sample_index: int | None = None  # None: every sample of the request


@dataclass(frozen=True)
class Shutdown:
    pass


# -- core -> frontend ------------------------------------------------------------------------
@dataclass(frozen=True)
class CoreReady:
    version: int
    model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    num_blocks: int
    stats: EngineStats
    # What ends a structured output: the frontend compiles constraints to validate them.
    grammar_stop_token_ids: list[int]

    @classmethod
    def of(cls, engine: LLMEngine) -> "CoreReady":
        """What a frontend needs to know of the engine a core runs."""
        return cls(
            PROTOCOL_VERSION,
            engine.model_name,
            engine.max_model_len,
            engine.model_config.vocab_size,
            engine.config.max_num_seqs,
            engine.block_manager.num_blocks,
            engine.stats(),
            engine.grammar_stop_token_ids,
        )


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
