"""The HTTP app: OpenAI's Files and Batches endpoints (and ``/v1/models``) over Redis.

Framework: Starlette, served by uvicorn. It is a small, well-kept ASGI toolkit (routing,
multipart uploads, lifespan, a test client) with few dependencies and no data-model layer
of its own: request bodies are validated with msgspec like the rest of mlxq, so pydantic
(which FastAPI would bring) has nothing to do here. Every handler is async and runs its
Redis work in Starlette's thread pool, since mlxq's queue code uses the sync Redis client.

Routes: ``POST /v1/files``, ``GET /v1/files``, ``GET /v1/files/{id}``,
``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``, ``POST /v1/batches``,
``GET /v1/batches``, ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``,
``GET /v1/models``, ``GET /v1/models/{id}``, and ``/v1/responses`` (any path under it),
which answers 404 saying that Responses requests run in batches. All of them need a bearer
API key unless the app is made without keys (loopback only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis

from mlxq.api import batch_create, batches, store
from mlxq.api.auth import TENANT, AuthMiddleware, KeyChecker, Tenant, owner_of
from mlxq.api.errors import ApiError, bad_request, decode_body
from mlxq.api.models import get_model, list_models
from mlxq.api.objects import FINAL_STATUSES, BatchState, encoder
from mlxq.api.uploads import DEFAULT_MAX_LINES, DEFAULT_MAX_UPLOAD_BYTES, read_upload
from mlxq.broker import batches as broker_batches
from mlxq.errors import needs_extra

with needs_extra("api", "mlxq api"):
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

log = logging.getLogger("mlxq.api")

DEFAULT_SWEEP_INTERVAL = 30.0


@dataclass
class ApiSettings:
    """How the app is configured; ``api_keys=None`` turns authentication off."""

    redis_url: str
    api_keys: list[str] | None
    admin_keys: list[str] = field(default_factory=list)  # keys that see every tenant's
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    max_lines: int = DEFAULT_MAX_LINES
    # Seconds between background refreshes of active batches (0: only on reads).
    sweep_interval: float = DEFAULT_SWEEP_INTERVAL
    # Queue batches for models no live worker serves (for workers started later) instead
    # of failing them with model_not_found.
    allow_unserved_models: bool = False
    # Models to accept batches for although no worker has served them yet (``--models``).
    expected_models: list[str] = field(default_factory=list)


class CreateBatchBody(msgspec.Struct):
    """The body of ``POST /v1/batches`` (other fields OpenAI takes are ignored)."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


_create_decoder = msgspec.json.Decoder(CreateBatchBody)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(encoder.encode(obj), status_code=status, media_type="application/json")


def _conn(request: Request) -> redis.Redis:
    return request.app.state.conn


def _settings(request: Request) -> ApiSettings:
    return request.app.state.settings


def _tenant(request: Request) -> Tenant | None:
    """The tenant the request's key is (None when the app runs without keys)."""
    return getattr(request.state, TENANT, None)


# -- files --------------------------------------------------------------------------------


async def upload_file(request: Request) -> Response:
    s = _settings(request)
    up = await read_upload(request, max_bytes=s.max_upload_bytes, max_lines=s.max_lines)
    record = await run_in_threadpool(
        store.put_file,
        _conn(request),
        up.content,
        filename=up.filename,
        purpose=up.purpose,
        owner=owner_of(_tenant(request)),
    )
    return _json(record)


async def list_files(request: Request) -> Response:
    params = request.query_params
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"Invalid order {order!r}: give 'asc' or 'desc'", param="order")
    files, has_more = await run_in_threadpool(
        store.list_files,
        _conn(request),
        tenant=_tenant(request),
        purpose=params.get("purpose") or None,
        after=params.get("after") or None,
        limit=_limit(params.get("limit"), default=10_000, most=10_000),
        desc=order == "desc",
    )
    return _list(files, has_more)


def _list(data: list[Any], has_more: bool) -> Response:
    """OpenAI's cursor page, which the ``openai`` client pages through by ``after``."""
    return _json(
        {
            "object": "list",
            "data": data,
            "first_id": data[0].id if data else None,
            "last_id": data[-1].id if data else None,
            "has_more": has_more,
        }
    )


async def get_file(request: Request) -> Response:
    conn, tenant = _conn(request), _tenant(request)
    return _json(await run_in_threadpool(store.get_file, conn, _id(request), tenant))


async def get_file_content(request: Request) -> Response:
    conn, tenant = _conn(request), _tenant(request)
    content = await run_in_threadpool(store.get_file_content, conn, _id(request), tenant)
    return Response(content, media_type="application/octet-stream")


async def delete_file(request: Request) -> Response:
    file_id = _id(request)
    await run_in_threadpool(store.delete_file, _conn(request), file_id, _tenant(request))
    return _json({"id": file_id, "object": "file", "deleted": True})


def _id(request: Request) -> str:
    return request.path_params["id"]


# -- batches ------------------------------------------------------------------------------


async def create_batch(request: Request) -> Response:
    body = decode_body(_create_decoder, await _small_body(request))
    state = await run_in_threadpool(
        batch_create.create_batch,
        _conn(request),
        tenant=_tenant(request),
        input_file_id=body.input_file_id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        metadata=body.metadata,
        max_lines=_settings(request).max_lines,
        allow_unserved=_settings(request).allow_unserved_models,
        expected_models=_settings(request).expected_models,
    )
    return _json(state.batch)


MAX_JSON_BODY = 1024 * 1024  # a batch's JSON body is a few hundred bytes


async def _small_body(request: Request) -> bytes:
    """The request's body, refused with a 413 past ``MAX_JSON_BODY`` bytes (not read on)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_JSON_BODY:
            raise ApiError(413, f"Request body too large: at most {MAX_JSON_BODY} bytes")
    return bytes(body)


async def get_batch(request: Request) -> Response:
    conn, batch_id = _conn(request), _id(request)
    await run_in_threadpool(store.get_batch, conn, batch_id, _tenant(request))  # else a 404
    state = await run_in_threadpool(batches.refresh, conn, batch_id)
    return _json(state.batch)


async def cancel_batch(request: Request) -> Response:
    conn, batch_id = _conn(request), _id(request)
    # Marks the batch (one script call: no job of it starts after this answer), then
    # answers; its waiting jobs are cancelled, and the batch finalized, on a thread.
    state = await run_in_threadpool(batches.cancel_batch, conn, batch_id, _tenant(request))
    if state.batch.status not in FINAL_STATUSES:
        batches.end_in_background(conn, batch_id)
    return _json(state.batch)


async def list_batches(request: Request) -> Response:
    after = request.query_params.get("after") or None
    limit = _limit(request.query_params.get("limit"), default=20, most=100)
    states, has_more = await run_in_threadpool(
        _listed, _conn(request), _tenant(request), after, limit
    )
    return _list([s.batch for s in states], has_more)


def _listed(
    conn: redis.Redis, tenant: Tenant | None, after: str | None, limit: int
) -> tuple[list[BatchState], bool]:
    states, has_more = store.list_batches(conn, tenant=tenant, after=after, limit=limit)
    fresh = [
        s if s.batch.status in FINAL_STATUSES else batches.refresh(conn, s.batch.id) for s in states
    ]
    return fresh, has_more


def _limit(raw: str | None, *, default: int, most: int) -> int:
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise bad_request(f"Invalid limit {raw!r}: give an integer from 1 to {most}", param="limit")
    return int(raw)


# -- models -------------------------------------------------------------------------------


async def get_models(request: Request) -> Response:
    expected = _settings(request).expected_models
    models = await run_in_threadpool(list_models, _conn(request), expected)
    return _json({"object": "list", "data": models})


async def get_model_by_id(request: Request) -> Response:
    expected = _settings(request).expected_models
    return _json(await run_in_threadpool(get_model, _conn(request), _id(request), expected))


# -- responses ----------------------------------------------------------------------------


async def responses_in_batches(request: Request) -> Response:
    """Any ``/v1/responses`` call: mlxq answers Responses requests in batches only, and
    keeps no response to fetch (a client falls back on 404, as for any missing route)."""
    raise ApiError(
        404,
        f"mlxq runs Responses requests in batches only ({request.method} "
        f"{request.url.path} is not served): upload a JSONL file of /v1/responses lines "
        'with purpose "batch" and create a batch with endpoint "/v1/responses"; each '
        "response is in the batch's output file",
        code="unsupported_endpoint",
    )


# -- app ----------------------------------------------------------------------------------

ROUTES = [
    Route("/v1/files", upload_file, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{id}", get_file, methods=["GET"]),
    Route("/v1/files/{id}", delete_file, methods=["DELETE"]),
    Route("/v1/files/{id}/content", get_file_content, methods=["GET"]),
    Route("/v1/batches", create_batch, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{id}", get_batch, methods=["GET"]),
    Route("/v1/batches/{id}/cancel", cancel_batch, methods=["POST"]),
    Route("/v1/models", get_models, methods=["GET"]),
    # Hub ids hold a "/" (mlx-community/Foo-4bit): the id is the rest of the path.
    Route("/v1/models/{id:path}", get_model_by_id, methods=["GET"]),
    Route("/v1/responses", responses_in_batches, methods=["GET", "POST"]),
    Route("/v1/responses/{rest:path}", responses_in_batches, methods=["GET", "POST", "DELETE"]),
]


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = str(exc.detail)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    return _error_response(ApiError(exc.status_code, message))


async def _redis_error(request: Request, exc: Exception) -> Response:
    log.error("Redis error on %s %s: %s", request.method, request.url.path, exc)
    return _error_response(ApiError(503, f"The queue's Redis is unavailable: {exc}"))


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client went away (or was cut off for being too slow): nobody reads an answer."""
    log.info("client left during %s %s", request.method, request.url.path)
    return Response(status_code=400)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error_response(ApiError(500, "The server had an error processing your request."))


def _error_response(error: ApiError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def create_app(settings: ApiSettings, conn: redis.Redis | None = None) -> Starlette:
    """The ASGI app for ``settings`` (``conn`` overrides the connection to ``redis_url``)."""
    conn = conn or broker_batches.connect(settings.redis_url)
    middleware = []
    if settings.api_keys is not None:
        checker = KeyChecker(settings.api_keys, admin=settings.admin_keys)
        middleware.append(Middleware(AuthMiddleware, checker=checker))
    app = Starlette(
        routes=ROUTES,
        middleware=middleware,
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            redis.RedisError: _redis_error,
            ClientDisconnect: _client_gone,
            Exception: _server_error,
        },
        lifespan=_lifespan(conn, settings.sweep_interval),
    )
    app.state.conn = conn
    app.state.settings = settings
    return app


def _lifespan(conn: redis.Redis, interval: float) -> Callable:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(_sweep_forever(conn, interval)) if interval > 0 else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    return lifespan


async def _sweep_forever(conn: redis.Redis, interval: float) -> None:
    """Refresh active batches every ``interval`` seconds, so batches are finalized and
    expire even when nobody polls them."""
    while True:
        await asyncio.sleep(interval)
        try:
            await run_in_threadpool(batches.sweep, conn)
        except Exception:
            log.exception("background sweep of active batches failed")
