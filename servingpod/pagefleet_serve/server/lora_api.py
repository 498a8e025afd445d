"""vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`: LoRA adapters loaded
and unloaded while the server runs, mounted only with `--allow-runtime-lora-updating`
(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).

A load answers once the core has read the adapter (off its step loop) and serves it as
`lora_name`; errors are OpenAI's JSON: 400 an adapter that cannot be read or does not fit
the model (the message names the file) or a rank over --max-lora-rank, 404 an unload of an
adapter that is not loaded, 409 an unload while requests use it.
"""

import re

from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from pagefleet_serve.config import LORA_NAME_PATTERN
from pagefleet_serve.frontend.core_client import EngineDeadError, LoRAAdapterError
from pagefleet_serve.server.errors import APIError, bad_request, unavailable
from pagefleet_serve.server.protocol import _CONFIG, parse
from pagefleet_serve.server.state import ServerState

_CODES = {404: "lora_adapter_not_found", 409: "lora_adapter_in_use"}


class LoadLoRAAdapterRequest(BaseModel):
    model_config = _CONFIG
    lora_name: str
    lora_path: str  # a local path, file://, pvc:// or hf://org/name[@revision]


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = _CONFIG
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name is what counts


class LoRAEndpoints:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def load(self, body: bytes) -> Response:
        request = parse(LoadLoRAAdapterRequest, body)
        name = request.lora_name
        if not re.match(LORA_NAME_PATTERN, name):
            raise bad_request(
                f"lora_name: {name!r} must be letters, digits, '.', '_' or '-', starting with "
                "a letter or digit",
                param="lora_name",
            )
        if name in self.state.settings.served_model_names:
            raise bad_request(f"lora_name: {name!r} is the base model's name", param="lora_name")
        await self._change(
            self.state.engine.load_lora_adapter(name, request.lora_path), "lora_path"
        )
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, body: bytes) -> Response:
        request = parse(UnloadLoRAAdapterRequest, body)
        name = request.lora_name
        await self._change(self.state.engine.unload_lora_adapter(name), "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @staticmethod
    async def _change(change, param: str) -> None:
        try:
            await change
        except LoRAAdapterError as exc:
            if exc.status >= 500:
                raise APIError(exc.status, str(exc), type="server_error") from None
            code = _CODES.get(exc.status, "invalid_lora_adapter")
            where = "lora_name" if exc.status in _CODES else param
            raise APIError(exc.status, str(exc), param=where, code=code) from None
        except EngineDeadError as exc:
            raise unavailable(
                f"the engine is not healthy: {exc}", code="engine_unhealthy"
            ) from None
