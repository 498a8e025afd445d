"""vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`: LoRA adapters loaded
and unloaded while the server runs, mounted only with `--allow-runtime-lora-updating`
(vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).

A load answers once the core has read the adapter (off its step loop) and serves it as
`lora_name`; a local `lora_path` only under --allowed-lora-root (without it, only hf://
adapters load at run time, as vLLM reads local media only under its allowed path). Errors
are OpenAI's JSON: 400 an adapter that does not fit the model or a rank over
--max-lora-rank (naming what is wrong), or whose files this server may not read (one text
whatever the reason, so that a client learns nothing of the server's files), 404 an
unload of an adapter that is not loaded, 409 an unload while requests use it.
"""

from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from pagefleet_serve.config import LORA_NAME_RULE, is_lora_name
from pagefleet_serve.frontend.core_client import EngineDeadError, LoRAAdapterError
from pagefleet_serve.server.errors import APIError, bad_request, unavailable
from pagefleet_serve.server.protocol import _CONFIG, parse
from pagefleet_serve.server.state import ServerState

_CODES = {
    404: "lora_adapter_not_found",
    409: "lora_adapter_in_use",
    429: "too_many_lora_adapters",
}


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
        if not is_lora_name(name):
            shown = name if len(name) <= 80 else f"{name[:80]}..."
            raise bad_request(f"lora_name: {shown!r} {LORA_NAME_RULE}", param="lora_name")
        if name in self.state.settings.served_model_names:
            raise bad_request(f"lora_name: {name!r} is the base model's name", param="lora_name")
        root = self.state.settings.allowed_lora_root
        if root is None and not request.lora_path.startswith("hf://"):
            raise APIError(
                400,
                "lora_path: this server loads adapters from local paths at run time only "
                "under --allowed-lora-root, which is not set; hf:// adapters load",
                param="lora_path",
                code="invalid_lora_adapter",
            )
        load = self.state.engine.load_lora_adapter(
            name, request.lora_path, from_client=True, allowed_root=root
        )
        await self._change(load, "lora_path")
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
