"""The ``mlxq dashboard`` web app: one static page and the JSON snapshot it polls.

Starlette, like ``mlxq api`` (the same ``api`` extra). ``GET /`` is a self-contained HTML
page (package data, no scripts or styles from the network, no build step) that fetches
``GET /api/state`` every couple of seconds and redraws in place. The page holds no data,
so it is served to anyone; ``/api/*`` needs a bearer API key when the app has keys (the
page asks for one, or takes it from the address's ``#key=`` fragment, which browsers
never send to the server). Read-only: no route changes anything.
"""

from __future__ import annotations

from importlib import resources

import redis

from mlxq.api.auth import AuthMiddleware, KeyChecker
from mlxq.api.dashboard_state import Dashboard
from mlxq.errors import needs_extra
from mlxq.wire import json_encoder

with needs_extra("api", "mlxq dashboard"):
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, Response
    from starlette.routing import Mount, Route

REFRESH_S = 2.0


def page() -> str:
    """The dashboard's HTML, with its refresh interval filled in."""
    text = resources.files("mlxq.api").joinpath("static/dashboard.html").read_text("utf-8")
    return text.replace("__REFRESH_MS__", str(int(REFRESH_S * 1000)))


def create_dashboard_app(conn: redis.Redis, api_keys: list[str] | None) -> Starlette:
    """The app; ``api_keys=None`` serves the JSON without authentication (loopback only)."""
    dashboard = Dashboard(conn)
    html = page()

    async def index(request: Request) -> Response:
        return HTMLResponse(html, headers=_NO_CACHE | _CSP)

    async def state(request: Request) -> Response:
        snap = await run_in_threadpool(dashboard.snapshot)
        return Response(json_encoder.encode(snap), media_type="application/json", headers=_NO_CACHE)

    middleware = [Middleware(AuthMiddleware, checker=KeyChecker(api_keys))] if api_keys else []
    api = Starlette(routes=[Route("/state", state)], middleware=middleware)
    return Starlette(routes=[Route("/", index), Mount("/api", app=api)])


_NO_CACHE = {"cache-control": "no-store"}
# The page may only talk to this server and runs only its own inline script and style.
_CSP = {
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
}
