"""PageFleet's serving pod: a paged-KV, continuously batching Llama engine and its server."""

from pagefleet_serve.config import EngineConfig
from pagefleet_serve.engine.llm import LLM
from pagefleet_serve.outputs import CompletionOutput, RequestOutput
from pagefleet_serve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
