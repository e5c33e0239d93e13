"""The FastAPI application: OpenAI routes, health, version, metrics, API-key check, and the mapping of
every failure to OpenAI's error shape with its status (never a 500 for bad input)."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api_requests import ChatCompletionRequest, CompletionRequest
from server.api_responses import ModelCard, ModelList
from server.engine_client import EngineClient
from server.errors import ApiError, ErrorResponse
from server.metrics import ServerMetrics
from server.openai_serving import OpenAIServing


def specserve_version() -> str:
    try:
        return version("specserve")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class ServerState:
    client: EngineClient
    serving: OpenAIServing
    metrics: ServerMetrics
    api_key: str | None = None
    # set on SIGTERM: new requests get 503 while in-flight ones finish
    draining: bool = False


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specserve", version=specserve_version(),
                  description="OpenAI-compatible inference with lossless speculative decoding")

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(ErrorResponse.from_validation_errors(error.errors()).model_dump(),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        # unknown routes, wrong methods, and bodies FastAPI cannot parse (e.g. not UTF-8)
        return JSONResponse(ApiError(error.status_code, str(error.detail)).body(),
                            status_code=error.status_code, headers=error.headers)

    async def authorized(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # NOTE: constant-time comparison, so response timing does not leak the key
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(),
                                                                 state.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                           code="invalid_api_key")

    async def accepting() -> None:
        if state.draining:
            raise ApiError(503, "the server is shutting down", retry_after=5)
        if not state.client.is_alive:
            raise ApiError(503, "the engine is not running")

    generation = [Depends(authorized), Depends(accepting)]

    @app.get("/health")
    async def health() -> Response:
        healthy = state.client.is_alive and not state.draining
        return Response(status_code=200 if healthy else 503)

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": specserve_version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.serving.served_model_name,
                                         max_model_len=state.serving.max_model_len)])

    @app.post("/v1/completions", dependencies=generation)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return _respond(await state.serving.completions(body, request.is_disconnected))

    @app.post("/v1/chat/completions", dependencies=generation)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return _respond(await state.serving.chat(body, request.is_disconnected))

    return app


def _respond(result) -> Response:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(result.model_dump(mode="json"))
