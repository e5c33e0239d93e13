"""The FastAPI application: OpenAI routes, health, version, metrics, API-key check, and the mapping of
every failure to OpenAI's error shape with its status (never a 500 for bad input)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api_key import ApiKeyCheck, request_tenant
from server.api_requests import ChatCompletionRequest, CompletionRequest
from server.api_responses import ModelCard, ModelList
from server.body_limit import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT, BodySizeLimit
from server.engine_client import EngineClient
from server.errors import ApiError, ErrorResponse
from server.generation import ClientDisconnected
from server.messages_errors import AnthropicErrorShape
from server.messages_serving import MessagesServing
from server.metrics import ServerMetrics
from server.openai_serving import OpenAIServing
from server.response_store import ResponseStore
from server.responses_api import ResponsesRequest
from server.responses_serving import DeletedResponse, ResponsesServing
from server.tokenize_api import (
    DetokenizeRequest,
    DetokenizeResponse,
    Tokenization,
    TokenizeRequest,
    TokenizeResponse,
)

# FastAPI's message when reading the body failed for a reason other than JSON syntax
_BODY_PARSE_FAILED = "There was an error parsing the body"


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
    # each key is a tenant of its own; empty: no key is asked for (one anonymous tenant)
    api_keys: tuple[str, ...] = ()
    # set on SIGTERM: new requests get 503 while in-flight ones finish
    draining: bool = False
    # larger request bodies get 413 before they are parsed
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # seconds a client has to send its body once its headers are in (then 408)
    read_timeout: float = DEFAULT_READ_TIMEOUT
    # responses kept for GET /v1/responses/{id} and previous_response_id, per tenant
    responses: ResponseStore = field(default_factory=ResponseStore)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specserve", version=specserve_version(),
                  description="OpenAI-compatible inference with lossless speculative decoding")
    app.add_middleware(BodySizeLimit, max_bytes=state.max_body_bytes,
                       read_timeout=state.read_timeout)
    if state.api_keys:
        # NOTE: added last, so it runs first: the key is checked before the body is read (401 first)
        app.add_middleware(ApiKeyCheck, api_keys=state.api_keys)
    # NOTE: outside every other middleware: errors on /v1/messages paths in Anthropic's shape
    app.add_middleware(AnthropicErrorShape)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        body_error = _whole_body_error(request, errors)
        response = (ErrorResponse.build(body_error) if body_error
                    else ErrorResponse.from_validation_errors(errors))
        return JSONResponse(response.model_dump(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        # unknown routes, wrong methods, and bodies FastAPI cannot parse (e.g. not UTF-8)
        message = str(error.detail)
        if error.status_code == 400 and message == _BODY_PARSE_FAILED:
            message = _body_parse_message(error.__cause__)
        return JSONResponse(ApiError(error.status_code, message).body(),
                            status_code=error.status_code, headers=error.headers)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, __: ClientDisconnected) -> Response:
        # NOTE: 499 as nginx logs it; nobody is left to read this response
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        # a bug, never bad input (that is a 4xx above); still answered in OpenAI's shape.
        # NOTE: Starlette calls this from its outermost middleware, which then logs the traceback
        message = f"internal server error ({type(error).__name__})"
        return JSONResponse(ApiError(500, message).body(), status_code=500)

    async def accepting() -> None:
        if state.draining:
            raise ApiError(503, "the server is shutting down", retry_after=5)
        if not state.client.is_alive:
            raise ApiError(503, "the engine is not running")

    generation = [Depends(accepting)]
    # NOTE: what the generation routes answer besides 200, as /openapi.json documents it
    errors = {status: {"model": ErrorResponse, "description": description}
              for status, description in ((400, "Invalid request"), (401, "Bad or missing API key"),
                                          (404, "Unknown model"), (413, "Request body too large"),
                                          (429, "Waiting queue full (see Retry-After)"),
                                          (503, "Engine down or server draining"))}

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

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.serving.served_model_name,
                                         max_model_len=state.serving.max_model_len)])

    tokenization = Tokenization(state.serving)

    @app.post("/tokenize", responses=errors)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(body)

    @app.post("/detokenize", responses=errors)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(body)

    @app.post("/v1/completions", dependencies=generation, responses=errors)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return _respond(await state.serving.completions(body, request.is_disconnected,
                                                        request_tenant(request)))

    @app.post("/v1/chat/completions", dependencies=generation, responses=errors)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return _respond(await state.serving.chat(body, request.is_disconnected,
                                                 request_tenant(request)))

    responses_api = ResponsesServing(state.serving, state.responses)

    @app.post("/v1/responses", dependencies=generation, responses=errors)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return _respond(await responses_api.create(body, request.is_disconnected,
                                                   request_tenant(request)))

    @app.get("/v1/responses/{response_id}", responses=errors)
    async def retrieve_response(response_id: str, request: Request) -> Response:
        return _respond(responses_api.retrieve(response_id, request_tenant(request)))

    @app.delete("/v1/responses/{response_id}", responses=errors)
    async def delete_response(response_id: str, request: Request) -> DeletedResponse:
        return responses_api.delete(response_id, request_tenant(request))

    messages_api = MessagesServing(state.serving)

    # NOTE: validated by messages_api itself, so its errors name Anthropic's fields; left out of
    # /openapi.json, whose error bodies are OpenAI's (these answer in Anthropic's shape)
    @app.post("/v1/messages", dependencies=generation, include_in_schema=False)
    async def create_message(request: Request, body: dict[str, Any] = Body()) -> Response:
        return _respond(await messages_api.create(body, request.is_disconnected,
                                                  request_tenant(request)))

    @app.post("/v1/messages/count_tokens", include_in_schema=False)
    async def count_message_tokens(body: dict[str, Any] = Body()) -> Response:
        return _respond(await messages_api.count_tokens(body))

    default_openapi = app.openapi

    def openapi() -> dict:
        # validation errors are answered 400 in OpenAI's shape, never FastAPI's 422
        schema = default_openapi()
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        return schema

    app.openapi = openapi
    return app


def _whole_body_error(request: Request, errors: list[dict]) -> str | None:
    """A message for errors about the body as a whole (not JSON, not an object, missing), which
    FastAPI reports with no field to name; None when the errors are about fields."""
    for error in errors:
        loc = tuple(error.get("loc", ()))
        if error.get("type") == "json_invalid":
            reason = error.get("ctx", {}).get("error", "invalid JSON")
            position = f" at character {loc[1]}" if len(loc) > 1 else ""
            return f"the request body is not valid JSON: {reason}{position}"
        if loc != ("body",):
            continue
        content_type = request.headers.get("content-type")
        if not _is_json(content_type):
            return (f"the request body must be JSON with Content-Type: application/json "
                    f"(got {content_type or 'no Content-Type'})")
        if error.get("type") == "missing":
            return "the request body is missing; send a JSON object"
        found = type(error.get("input")).__name__
        names = {"list": "an array", "str": "a string", "NoneType": "null", "int": "a number",
                 "float": "a number", "bool": "a boolean"}
        return f"the request body must be a JSON object, not {names.get(found, found)}"
    return None


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "").split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def _body_parse_message(cause: BaseException | None) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8: {cause}"
    if isinstance(cause, RecursionError):
        return "the request body is nested too deeply to parse"
    return "the request body could not be parsed as JSON"


def _respond(result) -> Response:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(result.model_dump(mode="json"))
