"""OpenAI's `POST /v1/embeddings`, served by an embed engine (task embed).

The body is read as the generation endpoints read theirs (JSON only, bounded in size),
then in the frontend thread: `input` (a string, a list of strings, a list of token ids or
a list of such lists; at most MAX_PROMPTS_PER_REQUEST inputs) is refused by its length in
characters before any tokenizer sees it, tokenized with the tokenizer's special tokens
(as sentence-transformers does), and each input checked against the context on its own.
Each input is one engine request, admitted and run as a `Generation`; the vectors come
back as floats or as base64 of little-endian float32 (OpenAI's `encoding_format`), cut to
`dimensions` where the model declares Matryoshka dimensions (400 otherwise).
"""

import base64
import math
import struct
import uuid
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from pagefleet_serve.frontend.embeddings import shape_embedding
from pagefleet_serve.frontend.input_processor import ContextLengthError, PromptTooLongError
from pagefleet_serve.messages import Request as EngineRequest
from pagefleet_serve.sampling_params import SamplingParams
from pagefleet_serve.server.errors import bad_request, server_error
from pagefleet_serve.server.fair_queue import current_client
from pagefleet_serve.server.generation import Generation
from pagefleet_serve.server.openai_api import PromptBounds, read_json_body, run_to_end
from pagefleet_serve.server.protocol import _BODY_CONFIG, MAX_PROMPTS_PER_REQUEST, parse

# An embedding request samples nothing: these settings are carried, never read.
_POOLING_PARAMS = SamplingParams(max_tokens=1)


class EmbeddingRequest(BaseModel):
    model_config = _BODY_CONFIG
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingsEndpoint(PromptBounds):
    prompt_param = "input"

    async def __call__(self, raw: Request) -> Response:
        body = await read_json_body(raw, self.state.settings.max_request_body_bytes)
        request_id = f"embd-{uuid.uuid4().hex}"
        request, engine_requests = await self.state.off_loop(
            lambda: self._validate(body, request_id)
        )
        generation = Generation(self.state, engine_requests)

        async def collect() -> None:
            async for _ in generation.stream(None, 0.0):
                pass

        if not await run_to_end(raw, generation, collect()):
            return Response(status_code=499)  # the client has gone; nobody reads this
        pooling = self.state.engine.pooling
        data = []
        for index in range(len(engine_requests)):
            vector = shape_embedding(generation.embeddings[index], pooling, request.dimensions)
            if not all(math.isfinite(v) for v in vector):  # overflow in a narrow dtype
                raise server_error(
                    f"the embedding of input {index} is not finite (the model overflowed in "
                    "its dtype); serve it in a wider --dtype"
                )
            data.append(
                {"object": "embedding", "index": index, "embedding": _encode(vector, request)}
            )
        num_tokens = generation.num_prompt_tokens
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": request.model or self.state.settings.model_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            }
        )

    def _validate(self, body: bytes, request_id: str) -> tuple[EmbeddingRequest, list]:
        """Body -> validated engine requests, one per input (frontend thread)."""
        pooling = self.state.engine.pooling
        if pooling is None:
            raise bad_request(
                f"{self.state.settings.model_name} generates text (task generate): it serves "
                "no embeddings; serve an embedding model (--task embed) for /v1/embeddings",
                param="model",
                code="model_not_supported",
            )
        request = parse(EmbeddingRequest, body)
        lora_name = self.state.check_model(request.model)
        if request.dimensions is not None:
            try:
                pooling.check_dimensions(request.dimensions)
            except ValueError as exc:
                raise bad_request(str(exc), param="dimensions") from None
        inputs = self._inputs(request.input)
        engine_requests: list[EngineRequest] = []
        for index, prompt in enumerate(inputs):  # stops at its first input over the context
            try:
                processed = self.state.engine.process_input(
                    {f"{request_id}-{index}": prompt},
                    _POOLING_PARAMS,
                    lora_name=lora_name,
                    pooling=True,
                    client=current_client(),
                )
                engine_requests += processed.requests
            except PromptTooLongError as exc:
                raise self.too_long(exc.num_chars) from None
            except ContextLengthError as exc:
                raise bad_request(
                    f"This model's maximum context length is {exc.max_model_len} tokens. "
                    f"However, input[{index}] has {exc.num_prompt_tokens} tokens. Please "
                    "reduce the length of the input.",
                    param="input",
                    code="context_length_exceeded",
                ) from None
            except ValueError as exc:
                raise bad_request(f"input[{index}]: {exc}", param="input") from None
        return request, engine_requests

    def _inputs(self, given) -> list[str | list[int]]:
        """`input` as a list of prompts, each text or token ids; 400 when empty or too many."""
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        if not given:
            raise bad_request("input: must not be empty", param="input")
        if len(given) > MAX_PROMPTS_PER_REQUEST:
            raise bad_request(
                f"input: at most {MAX_PROMPTS_PER_REQUEST} inputs per request, got {len(given)}",
                param="input",
            )
        if any(not prompt for prompt in given):
            raise bad_request("input: every input must be non-empty", param="input")
        if isinstance(given[0], str):
            self.check_tokenizer()
            self.check_batch_chars(sum(map(len, given)))
        return list(given)


def _encode(vector: list[float], request: EmbeddingRequest) -> list[float] | str:
    if request.encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
