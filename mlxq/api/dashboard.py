"""The ``mlxq dashboard`` web app: one static page and the JSON snapshot it polls.

Starlette, like ``mlxq api`` (the same ``api`` extra). ``GET /`` is a self-contained HTML
page (package data, no scripts or styles from the network, no build step) that fetches
``GET /api/state`` every couple of seconds and redraws in place. The page holds no data,
so it is served to anyone; ``/api/*`` needs a bearer API key when the app has keys (the
page asks for one, or takes it from the address's ``#key=`` fragment, which browsers
never send to the server). Read-only: no route changes anything. While Redis cannot be
read, ``/api/state`` answers 503 with ``{"error": "..."}`` saying so (the page shows it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from importlib import resources

import redis

from mlxq.api.auth import AuthMiddleware, KeyChecker
from mlxq.api.dashboard_health import STUCK_AFTER_S
from mlxq.api.dashboard_state import Dashboard
from mlxq.errors import needs_extra
from mlxq.wire import json_encoder

with needs_extra("api", "mlxq dashboard"):
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Mount, Route

REFRESH_S = 2.0
log = logging.getLogger("mlxq.dashboard")


def page() -> str:
    """The dashboard's HTML, with its refresh interval filled in."""
    text = resources.files("mlxq.api").joinpath("static/dashboard.html").read_text("utf-8")
    return text.replace("__REFRESH_MS__", str(int(REFRESH_S * 1000)))


def redis_where(conn: redis.Redis) -> str:
    """Where ``conn`` points (``host:port`` or the socket path), never its credentials."""
    kw = conn.connection_pool.connection_kwargs
    if kw.get("path"):
        return f"unix:{kw['path']}"
    return f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"


def redis_problem(e: redis.RedisError, where: str) -> str:
    """One line for the page: what went wrong with Redis at ``where``."""
    if isinstance(e, redis.AuthenticationError):
        return f"Redis at {where} refused the credentials ({e}); check --redis-url"
    if isinstance(e, redis.ConnectionError | redis.TimeoutError):
        return f"cannot reach Redis at {where}: {e}"
    return f"Redis at {where} answered with an error: {e}"


class _Outage:
    """Logs one line when Redis becomes unreadable and one when it is back (not one per
    poll, and no traceback)."""

    def __init__(self, where: str) -> None:
        self.where, self.down = where, False

    def failed(self, e: redis.RedisError) -> str:
        message = redis_problem(e, self.where)
        if not self.down:
            log.warning("%s; answering 503 until it is back", message)
        self.down = True
        return message

    def ok(self) -> None:
        if self.down:
            log.warning("Redis at %s is back", self.where)
        self.down = False


def create_dashboard_app(
    conn: redis.Redis, api_keys: list[str] | None, stuck_after_s: float = STUCK_AFTER_S
) -> Starlette:
    """The app; ``api_keys=None`` serves the JSON without authentication (loopback only).
    ``stuck_after_s``: flag a batch with work left and no job ended for this long."""
    dashboard = Dashboard(conn, stuck_after_s=stuck_after_s)
    outage = _Outage(redis_where(conn))
    html = page()

    async def index(request: Request) -> Response:
        return HTMLResponse(html, headers=_NO_CACHE | _CSP)

    async def state(request: Request) -> Response:
        try:
            snap = await run_in_threadpool(dashboard.snapshot)
        except redis.RedisError as e:
            error = {"error": outage.failed(e)}
            return JSONResponse(error, status_code=503, headers=_NO_CACHE)
        outage.ok()
        return Response(json_encoder.encode(snap), media_type="application/json", headers=_NO_CACHE)

    middleware = [Middleware(AuthMiddleware, checker=KeyChecker(api_keys))] if api_keys else []
    api = Starlette(routes=[Route("/state", state)], middleware=middleware)
    return Starlette(
        routes=[Route("/", index), Mount("/api", app=api)], lifespan=_sampling(dashboard)
    )


def _sampling(
    dashboard: Dashboard,
) -> Callable[[Starlette], contextlib.AbstractAsyncContextManager[None]]:
    """Samples the fleet's tokens every refresh while the app runs, page open or not, so
    the tokens/s chart has its history when someone looks."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        stop = threading.Event()

        def loop() -> None:
            while True:
                with contextlib.suppress(redis.RedisError):  # /api/state says so
                    dashboard.sample()
                if stop.wait(REFRESH_S):
                    return

        thread = threading.Thread(target=loop, name="dashboard-sampler", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)

    return lifespan


_NO_CACHE = {"cache-control": "no-store"}
# The page may only talk to this server and runs only its own inline script and style.
_CSP = {
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
}
