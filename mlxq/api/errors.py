"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Code anywhere in the API raises :class:`ApiError`; the app (``mlxq.api.app``) turns it, and
Starlette's own 404/405s, into a JSON response of that shape, so the ``openai`` client raises
its usual exceptions (``AuthenticationError``, ``NotFoundError``, ``BadRequestError``...).
This module does not import the web framework, so the batch lifecycle can use it anywhere.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_TYPES = {
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """An error answered with ``status`` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI sends for an error."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 ``invalid_request_error``."""
    return ApiError(400, message, param=param, code=code)


def not_found(kind: str, object_id: str, param: str = "id") -> ApiError:
    """A 404 worded as OpenAI words it: ``No such File object: file-...``."""
    return ApiError(404, f"No such {kind} object: {object_id}", param=param)


def decode_body(decoder: msgspec.json.Decoder[T], raw: bytes) -> T:
    """A JSON request body decoded, or a 400 that says what is wrong with it."""
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as e:
        raise bad_request(f"Invalid request body: {e}") from e
    except RecursionError as e:  # msgspec's own depth limit: a hostile body, not a bug
        raise bad_request(
            "Invalid request body: JSON nested too deeply; send a flat JSON object"
        ) from e
