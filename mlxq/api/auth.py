"""Bearer API keys: where they come from, and an ASGI middleware that checks them.

Keys come from ``MLXQ_API_KEYS`` (comma-separated) and a keys file (one per line; blank
lines and ``#`` comments are skipped). Admin keys come from ``MLXQ_API_ADMIN_KEYS`` and from
keys-file lines that end in the word ``admin`` (``sk-ops-1 admin``). A request is let
through only with ``Authorization: Bearer <key>`` for one of them. The check compares
SHA-256 digests with ``hmac.compare_digest`` against every key, so its time says nothing
about how much of a key, or which key, matched.

Each key is a tenant (:class:`Tenant`): the files and batches it creates are its own, and
other keys neither see nor touch them; an admin key sees and manages every tenant's.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from mlxq.api.errors import ApiError

ENV_API_KEYS = "MLXQ_API_KEYS"
ENV_ADMIN_KEYS = "MLXQ_API_ADMIN_KEYS"
ADMIN_MARK = "admin"  # a keys-file line "KEY admin" makes KEY an admin key
TENANT = "tenant"  # where the middleware puts the request's Tenant in its ASGI state


@dataclass(frozen=True)
class Tenant:
    """Who a request acts for: ``owner`` names the key's files and batches (a digest of
    the key, never the key itself); an ``admin`` key sees every tenant's."""

    owner: str
    admin: bool = False


def sees(tenant: Tenant | None, owner: str | None) -> bool:
    """Whether ``tenant`` may see and manage an object ``owner`` created; ``None`` (no
    authentication) and admin keys see all."""
    return tenant is None or tenant.admin or owner == tenant.owner


def owner_of(tenant: Tenant | None) -> str | None:
    """The owner recorded on what ``tenant`` creates (none without authentication)."""
    return tenant.owner if tenant else None


def load_keys(keys_file: str | Path | None, env: dict[str, str] | None = None) -> list[str]:
    """The API keys (admin ones included) from the environment and the keys file, without
    blanks or repeats."""
    return list(load_key_roles(keys_file, env))


def load_key_roles(
    keys_file: str | Path | None, env: dict[str, str] | None = None
) -> dict[str, bool]:
    """Every API key, mapped to whether it is an admin key."""
    env = os.environ if env is None else env
    roles = {k.strip(): False for k in env.get(ENV_API_KEYS, "").split(",")}
    roles |= {k.strip(): True for k in env.get(ENV_ADMIN_KEYS, "").split(",")}
    if keys_file is not None:
        for n, line in enumerate(Path(keys_file).read_text().splitlines(), 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if len(words) > 2 or (len(words) == 2 and words[1] != ADMIN_MARK):
                raise ValueError(
                    f"{keys_file}, line {n}: expected `KEY` or `KEY {ADMIN_MARK}` "
                    f"(keys hold no spaces), got {len(words)} words"
                )
            roles[words[0]] = roles.get(words[0], False) or len(words) == 2
    roles.pop("", None)
    return roles


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class KeyChecker:
    """Checks a presented key against the configured ones in constant time."""

    def __init__(self, keys: list[str], admin: Collection[str] = ()) -> None:
        if not keys:
            raise ValueError("no API keys")
        self._tenants = [
            (_digest(k), Tenant(owner=_digest(k).hex()[:24], admin=k in admin)) for k in keys
        ]

    def tenant(self, presented: bytes) -> Tenant | None:
        """The tenant of a presented key, or None if it is no key of ours."""
        given = _digest(presented)
        found = None
        for digest, tenant in self._tenants:  # no early exit: every key is compared
            if hmac.compare_digest(given, digest):
                found = tenant
        return found

    def valid(self, presented: bytes) -> bool:
        """Whether ``presented`` is one of the keys."""
        return self.tenant(presented) is not None


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
        tenant = self.checker.tenant(token) if token is not None else None
        if tenant is not None:
            scope.setdefault("state", {})[TENANT] = tenant  # request.state.tenant
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
