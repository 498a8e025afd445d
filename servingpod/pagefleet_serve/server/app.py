"""The FastAPI app of a serving pod: the OpenAI routes (behind the API key when one is
set), health, readiness, metrics, and OpenAI-shaped errors for everything.

The generation routes read their bodies themselves (size-limited, off the event loop), so
FastAPI does not validate them; their pydantic models are declared in the OpenAPI schema
by hand. /docs and /openapi.json are off when an API key is set, unless asked for."""

import asyncio
import hmac
import importlib.metadata
import logging
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagefleet_serve.server import anthropic_protocol
from pagefleet_serve.server.anthropic_api import CountTokensEndpoint, MessagesEndpoint
from pagefleet_serve.server.completions_api import CompletionsEndpoint
from pagefleet_serve.server.embeddings_api import EmbeddingRequest, EmbeddingsEndpoint
from pagefleet_serve.server.errors import APIError, server_error, unavailable
from pagefleet_serve.server.fair_queue import ClientMiddleware
from pagefleet_serve.server.lora_api import (
    LoadLoRAAdapterRequest,
    LoRAEndpoints,
    UnloadLoRAAdapterRequest,
)
from pagefleet_serve.server.metrics import CONTENT_TYPE
from pagefleet_serve.server.openai_api import ChatCompletionsEndpoint, list_models, read_json_body
from pagefleet_serve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagefleet_serve.server.refusals import RefusalGuard, work_seconds
from pagefleet_serve.server.responses_api import ResponsesEndpoint, ResponsesRequest
from pagefleet_serve.server.state import ServerState
from pagefleet_serve.server.tokenize_api import (
    DetokenizeRequest,
    TokenizeEndpoints,
    TokenizeRequest,
)
from pagefleet_serve.server.tracing import install_tracing

_SCHEMA_REF = "#/components/schemas/{model}"

logger = logging.getLogger(__name__)


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        state.shutdown()

    docs = state.settings.docs_enabled
    app = FastAPI(
        title="PageFleet serving pod",
        lifespan=lifespan,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    app.state.server = state
    app.add_middleware(ClientMiddleware)  # whose turn in the frontend thread (fair_queue)
    started = int(time.time())

    async def require_api_key(request: Request) -> None:
        # Proxies disagree on which of several Authorization headers counts (first or
        # last): a request that sends more than one is refused rather than guessed at.
        if len(request.headers.getlist("authorization")) > 1:
            raise APIError(
                400,
                "More than one Authorization header; send exactly one.",
                param="authorization",
                code="duplicate_header",
            )
        key = state.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization")
        if given is not None:
            scheme, _, token = given.partition(" ")
            token = token if scheme.lower() == "bearer" else ""
        else:  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "")
        if not token or not hmac.compare_digest(token.encode(), key.encode()):
            raise APIError(
                401,
                "Incorrect or missing API key; send 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    api = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
    completions = CompletionsEndpoint(state)
    chat = ChatCompletionsEndpoint(state)
    embeddings = EmbeddingsEndpoint(state)
    responses = ResponsesEndpoint(state)
    messages = MessagesEndpoint(state)
    count_tokens = CountTokensEndpoint(state)

    @api.get("/models")
    def models() -> dict:
        return list_models(state, started)

    @api.post("/completions", openapi_extra=_json_body(CompletionRequest))
    async def create_completion(raw: Request) -> Response:
        return await completions(raw)

    @api.post("/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def create_chat_completion(raw: Request) -> Response:
        return await chat(raw)

    @api.post("/responses", openapi_extra=_json_body(ResponsesRequest))
    async def create_response(raw: Request) -> Response:
        return await responses(raw)

    @api.post("/messages", openapi_extra=_json_body(anthropic_protocol.MessagesRequest))
    async def create_message(raw: Request) -> Response:
        return await messages(raw)

    @api.post(
        "/messages/count_tokens",
        openapi_extra=_json_body(anthropic_protocol.CountTokensRequest),
    )
    async def count_message_tokens(raw: Request) -> Response:
        return await count_tokens(raw)

    @api.get("/responses/{response_id}")
    def retrieve_response(response_id: str, raw: Request) -> Response:
        return responses.retrieve(response_id, raw)

    @api.delete("/responses/{response_id}")
    def delete_response(response_id: str) -> Response:
        return responses.delete(response_id)

    @api.post("/embeddings", openapi_extra=_json_body(EmbeddingRequest))
    async def create_embedding(raw: Request) -> Response:
        return await embeddings(raw)

    bodies: tuple[type[BaseModel], ...] = ()
    if state.settings.allow_runtime_lora_updating:
        lora = LoRAEndpoints(state)
        bodies = (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)

        @api.post("/load_lora_adapter", openapi_extra=_json_body(LoadLoRAAdapterRequest))
        async def load_lora_adapter(raw: Request) -> Response:
            return await lora.load(await read_json_body(raw, state.settings.max_request_body_bytes))

        @api.post("/unload_lora_adapter", openapi_extra=_json_body(UnloadLoRAAdapterRequest))
        async def unload_lora_adapter(raw: Request) -> Response:
            body = await read_json_body(raw, state.settings.max_request_body_bytes)
            return await lora.unload(body)

    app.include_router(api)

    # vLLM serves these outside /v1; they answer with the server's tokenizer, so they sit
    # behind the API key too.
    tokenizing = APIRouter(dependencies=[Depends(require_api_key)])
    tokenize_endpoints = TokenizeEndpoints(state)

    async def tokenizing_call(raw: Request, work) -> JSONResponse:
        body = await read_json_body(raw, state.settings.max_request_body_bytes)
        return JSONResponse(await state.off_loop(lambda: work(body)))

    @tokenizing.post("/tokenize", openapi_extra=_json_body(TokenizeRequest))
    async def tokenize(raw: Request) -> Response:
        return await tokenizing_call(raw, tokenize_endpoints.tokenize)

    @tokenizing.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize(raw: Request) -> Response:
        return await tokenizing_call(raw, tokenize_endpoints.detokenize)

    app.include_router(tokenizing)
    app.openapi = lambda: _openapi(
        app,
        (
            CompletionRequest,
            ChatCompletionRequest,
            EmbeddingRequest,
            ResponsesRequest,
            anthropic_protocol.MessagesRequest,
            anthropic_protocol.CountTokensRequest,
            TokenizeRequest,
            DetokenizeRequest,
            *bodies,
        ),
    )

    _install_probes(app, state)
    _install_error_handlers(
        app, RefusalGuard(state.settings.refusals_per_second, state.settings.refusal_delay)
    )
    install_tracing(app, state.settings.otlp_traces_endpoint)
    return app


def _install_probes(app: FastAPI, state: ServerState) -> None:
    """The routes outside the API key: liveness, readiness, version and metrics."""

    @app.get("/health")
    def health() -> Response:
        reason = state.engine.unhealthy_reason
        if reason is None:
            return Response(status_code=200)
        return unavailable(
            f"the engine is not healthy: {reason}", code="engine_unhealthy"
        ).response()

    @app.get("/ready")
    def ready() -> Response:
        if state.draining:
            return unavailable(
                "the server is shutting down", code="server_shutting_down"
            ).response()
        if not state.engine.is_healthy:
            return unavailable("the engine is not healthy", code="engine_unhealthy").response()
        return JSONResponse({"status": "ready"})

    @app.get("/version")
    def version() -> dict:
        # vLLM's route (its clients read it to tell servers apart): the package's version.
        return {"version": importlib.metadata.version("pagefleet")}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _install_error_handlers(app: FastAPI, refusals: RefusalGuard) -> None:
    """Every error as OpenAI's JSON: ours, FastAPI's validation, Starlette's, unexpected;
    a client's refusals past its allowance answered late (`refusals`)."""

    async def refuse(request: Request, error: APIError) -> Response:
        if error.status_code < 500:
            client = request.client.host if request.client else ""
            work = 0.0 if error.status_code == 429 else work_seconds(request.scope)
            delay = refusals.record(client, work)
            if delay:
                await asyncio.sleep(delay)
        return _render(request, error)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return await refuse(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return await refuse(request, APIError(400, f"{where}: {first['msg']}", param=where))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers)
        return await refuse(request, error)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return _render(request, server_error("internal server error"))


def _render(request: Request, error: APIError) -> Response:
    """An error in the shape of the API the path belongs to: Anthropic's for /v1/messages,
    OpenAI's everywhere else."""
    if request.url.path.startswith("/v1/messages"):
        return anthropic_protocol.error_response(error)
    return error.response()


def _json_body(model: type[BaseModel]) -> dict:
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": _SCHEMA_REF.format(model=model.__name__)}}
            },
        }
    }


def _openapi(app: FastAPI, bodies: tuple[type[BaseModel], ...]) -> dict:
    """FastAPI's schema plus the request bodies the routes read themselves."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in bodies:
            body = model.model_json_schema(ref_template=_SCHEMA_REF)
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema
