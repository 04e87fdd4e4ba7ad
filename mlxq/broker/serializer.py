"""RQ serializer built on msgspec JSON: never pickle.

RQ pickles job data, meta and results by default; a worker that unpickles from a shared
Redis runs whatever code a writer put there. This serializer only ever produces plain
JSON values (dict, list, str, int, float, bool, None), so a hostile payload can at worst
fail to decode.
"""

from __future__ import annotations

from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


class JSONSerializer:
    """``rq`` serializer protocol (``dumps``/``loads``) over msgspec JSON."""

    @staticmethod
    def dumps(obj: Any, /) -> bytes:
        """Encode plain data and msgspec Structs to JSON bytes."""
        return _encoder.encode(obj)

    @staticmethod
    def loads(data: bytes | str, /) -> Any:
        """Decode JSON bytes into plain Python values; anything else raises."""
        return _decoder.decode(data)


# What RQ gets as `serializer=`: the class works as a stateless serializer object.
serializer = JSONSerializer
