"""What every mlxq command shares: the ``--redis-url`` option, connecting, failing, progress
bars."""

from __future__ import annotations

import contextlib
import errno
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import click
import redis

from mlxq.broker import batches as q
from mlxq.broker import keys
from mlxq.errors import StartupError

DEFAULT_LOCAL_URL = "redis://127.0.0.1:6379/0"


def redis_option(f: Callable) -> Callable:
    """``--redis-url`` as every mlxq command takes it (``MLXQ_REDIS_URL``)."""
    return click.option(
        "--redis-url",
        envvar=keys.ENV_REDIS_URL,
        show_envvar=True,
        default=DEFAULT_LOCAL_URL,
        show_default=True,
        help="Redis/Valkey to use (redis://, rediss:// for TLS, unix://).",
    )(f)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``mlxq: error: MESSAGE`` on stderr and exit."""
    click.echo(f"mlxq: error: {message}", err=True)
    sys.exit(code)


@contextlib.contextmanager
def progress_bar(total: int, label: str) -> Iterator[Any]:
    """A click progress bar on stderr counting to ``total`` (position and ETA shown)."""
    with click.progressbar(
        length=total, label=label, file=sys.stderr, show_pos=True, show_eta=True, width=30
    ) as bar:
        yield bar


def describe_url(url: str) -> str:
    """Where ``url`` points, without its credentials: ``host:port/db`` or the socket path."""
    try:
        parts = redis.connection.parse_url(url)
    except ValueError:
        return "the configured server"
    if "path" in parts:
        return f"unix:{parts['path']}"
    where = f"{parts.get('host', '127.0.0.1')}:{parts.get('port', 6379)}"
    return f"{where}/{parts['db']}" if "db" in parts else where


def redacted(text: str, url: str) -> str:
    """``text`` with the URL's password (if any) masked, should an error quote it."""
    try:
        password = redis.connection.parse_url(url).get("password")
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text


def require_noeviction(conn: redis.Redis, url: str) -> None:
    """Exit 1, saying how to fix it, if this Redis may evict mlxq's keys when full."""
    from mlxq.broker.eviction import eviction_problem, maxmemory_policy

    policy = maxmemory_policy(conn)
    if policy is None:
        click.echo(
            f"mlxq: warning: cannot read maxmemory-policy of Redis at {describe_url(url)}; "
            "make sure it is noeviction, or jobs and results may be evicted when it is full",
            err=True,
        )
        return
    try:
        parts = redis.connection.parse_url(url)
    except ValueError:
        parts = {}
    problem = eviction_problem(policy, parts.get("host", "HOST"), parts.get("port", 6379))
    if problem:
        fail(f"{problem} (Redis at {describe_url(url)})")


def connect(url: str, *, writes_jobs: bool = False) -> redis.Redis:
    """A client for ``url`` that has answered a PING, or exit 1 saying why not.

    ``writes_jobs``: also refuse a Redis that may evict keys (workers, submit, the API).
    """
    where = describe_url(url)
    try:
        conn = q.connect(url)
        conn.ping()
    except redis.AuthenticationError as e:
        fail(
            f"Redis at {where} refused the credentials ({redacted(str(e), url)}); check the "
            f"password in --redis-url / {keys.ENV_REDIS_URL} (redis://:PASSWORD@host:port/db)"
        )
    except (redis.RedisError, ValueError) as e:
        fail(
            f"cannot reach Redis at {where} ({redacted(str(e), url)}); start one "
            f"with `mlxq server`, or set --redis-url / {keys.ENV_REDIS_URL}"
        )
    if writes_jobs:
        require_noeviction(conn, url)
    return conn


def check_port_free(host: str, port: int, option: str) -> None:
    """Refuse, in one line, a port another process already listens on (before serving)."""
    if port == 0:
        return  # the system picks a free one
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            cause = "in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
            raise StartupError(
                f"cannot listen on {host}:{port} ({cause}): stop what uses it, or pick "
                f"another {option}"
            ) from e
