"""Bearer API keys: where they come from, and an ASGI middleware that checks them.

Keys come from ``MLXQ_API_KEYS`` (comma-separated) and a keys file (one per line; blank
lines and ``#`` comments are skipped). A request is let through only with
``Authorization: Bearer <key>`` for one of them. The check compares SHA-256 digests with
``hmac.compare_digest`` against every key, so its time says nothing about how much of a
key, or which key, matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Any

import msgspec

from mlxq.api.errors import ApiError

ENV_API_KEYS = "MLXQ_API_KEYS"


def load_keys(keys_file: str | Path | None, env: dict[str, str] | None = None) -> list[str]:
    """The API keys from the environment and the keys file, without blanks or repeats."""
    env = os.environ if env is None else env
    keys = [k.strip() for k in env.get(ENV_API_KEYS, "").split(",")]
    if keys_file is not None:
        for line in Path(keys_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return list(dict.fromkeys(k for k in keys if k))


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class KeyChecker:
    """Checks a presented key against the configured ones in constant time."""

    def __init__(self, keys: list[str]) -> None:
        if not keys:
            raise ValueError("no API keys")
        self._digests = [_digest(k) for k in keys]

    def valid(self, presented: bytes) -> bool:
        given = _digest(presented)
        ok = False
        for d in self._digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(given, d)
        return ok


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of an ``Authorization: Bearer`` header, if there is one."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class AuthMiddleware:
    """ASGI middleware: HTTP requests without a valid bearer key get OpenAI's 401."""

    def __init__(self, app: Any, checker: KeyChecker) -> None:
        self.app = app
        self.checker = checker

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope.get("headers", []))
        if token is not None and self.checker.valid(token):
            await self.app(scope, receive, send)
            return
        if token is None:
            message = (
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        else:
            message = "Incorrect API key provided."
        error = ApiError(401, message, code="invalid_api_key")
        await _send_json(send, 401, error.body(), [(b"www-authenticate", b"Bearer")])


async def _send_json(send: Any, status: int, body: Any, headers: list) -> None:
    payload = msgspec.json.encode(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
