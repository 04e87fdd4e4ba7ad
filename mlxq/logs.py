"""Log set-up for the commands: plain text for people, one JSON object a line for machines."""

from __future__ import annotations

import logging
import sys
import time

import msgspec

_encoder = msgspec.json.Encoder()


class JSONFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "message", ["exc"]}`` per record, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return _encoder.encode(entry).decode()


def setup(level: str = "INFO", fmt: str = "text") -> None:
    """Send every log record (mlxq's and RQ's) to stderr as text or JSON."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
