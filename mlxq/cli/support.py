"""What every mlxq command shares: the ``--redis-url`` option, connecting, failing, progress
bars (and ``--priority``, which the commands that submit share)."""

from __future__ import annotations

import contextlib
import errno
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import click
import redis

from mlxq.broker import batches, keys
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
        callback=check_redis_url,
        help="Redis/Valkey to use (redis://, rediss:// for TLS, unix://).",
    )(f)


def priority_option(f: Callable) -> Callable:
    """``--priority`` of a batch, as ``mlxq submit`` and ``mlxq run`` take it."""
    return click.option(
        "--priority",
        type=click.Choice(keys.PRIORITIES),
        default=keys.DEFAULT_PRIORITY,
        show_default=True,
        help="Workers take a higher priority's jobs first; batches of equal priority share "
        "the workers a job at a time.",
    )(f)


def check_redis_url(_ctx: Any, _param: Any, url: str | None) -> str | None:
    """A click callback: exit 1 in one line if ``url`` is not a Redis URL (as it is parsed,
    before anything slow such as loading a model)."""
    problem = url_problem(url) if url else None
    if problem:
        fail(problem)
    return url


def url_problem(url: str) -> str | None:
    """What is wrong with the syntax of a Redis URL, with the fix, or None."""
    shown = url if "@" not in url else "***@" + url.rpartition("@")[2]  # no password
    if "://" not in url:
        return (
            f"--redis-url {shown} is not a URL: it needs a scheme (redis://, rediss:// for "
            f"TLS, unix://), e.g. redis://{shown}"
        )
    try:
        redis.connection.parse_url(url)
    except ValueError as e:
        return f"--redis-url {redacted(str(e), url)} (in {shown}); e.g. redis://127.0.0.1:6379/0"
    return None


LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level_option(default: str = "info") -> Callable[[Callable], Callable]:
    """``--log-level`` as every mlxq command takes it: the same choices, any case; the
    command gets the level's name upper-cased (as ``logging`` spells it)."""
    return click.option(
        "--log-level",
        default=default,
        show_default=True,
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        callback=lambda _ctx, _param, v: v.upper(),
        help="How much to log (debug adds tracebacks to errors).",
    )


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``mlxq: error: MESSAGE`` on stderr and exit."""
    click.echo(f"mlxq: error: {message}", err=True)
    sys.exit(code)


@contextlib.contextmanager
def progress_bar(total: int, label: str) -> Iterator[Any]:
    """A click progress bar on stderr counting to ``total``: position, and the time left at
    the recent rate (:class:`RecentEta`)."""
    eta = RecentEta(total)
    with click.progressbar(
        length=total, label=label, file=sys.stderr, show_pos=True, item_show_func=eta, width=30
    ) as bar:
        eta.bar = bar
        yield bar


class RecentEta:
    """The time left, labelled, at the rate of the last ``window`` seconds of progress.

    Measured from the first progress seen, so a slow start (a model compiling, a first
    prefill) does not inflate it (click's ETA divides by the time since the start). A
    click ``item_show_func``: called at each redraw, it reads the bar's position.
    """

    def __init__(
        self, total: int, window: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.total, self.window, self.clock = total, window, clock
        self.bar: Any = None  # set once the bar exists
        self._seen: deque[tuple[float, int]] = deque()  # (time, position) at each change
        self._moved = False  # whether the position has changed since the bar started

    def __call__(self, _item: object = None) -> str | None:
        return None if self.bar is None else self.at(self.bar.pos)

    def at(self, pos: int) -> str | None:
        """``about 1m20s left`` at position ``pos`` now, or None while the rate is unknown."""
        now = self.clock()
        if not self._seen or (pos > self._seen[-1][1] and self._moved):
            self._seen.append((now, pos))
        elif pos > self._seen[-1][1]:  # the first progress: the rate is measured from here
            self._seen = deque([(now, pos)])
            self._moved = True
        while len(self._seen) > 2 and self._seen[-1][0] - self._seen[1][0] >= self.window:
            self._seen.popleft()
        (t0, p0), (t1, p1) = self._seen[0], self._seen[-1]
        if p1 <= p0 or t1 <= t0 or pos >= self.total:
            return None
        left = (self.total - pos) * (t1 - t0) / (p1 - p0)
        return f"about {_duration(left)} left"


def _duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m"


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
    problem = url_problem(url)
    if problem:
        fail(problem)
    where = describe_url(url)
    try:
        conn = batches.connect(url)
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


FULL_FIX = (
    "raise maxmemory (`CONFIG SET maxmemory <bytes>`) or free space (write finished batches "
    "out with `mlxq results BATCH -o FILE`, then submit with a lower --result-ttl so "
    "results expire sooner)"
)


def redis_problem(error: redis.RedisError, url: str) -> str:
    """A Redis error as one line that says what to do: a full Redis (``noeviction`` at
    ``maxmemory``) with the fix, a read-only replica, a lost connection, or the error."""
    where = describe_url(url)
    if isinstance(error, redis.OutOfMemoryError):
        return f"Redis is full (maxmemory reached, noeviction) at {where}: {FULL_FIX}"
    if isinstance(error, redis.ReadOnlyError):
        return f"Redis at {where} is a read-only replica: point --redis-url at the primary"
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError)):
        return f"lost Redis at {where} ({redacted(str(error), url)}); run the command again"
    return f"Redis at {where}: {redacted(str(error), url)}"


@contextlib.contextmanager
def redis_errors(url: str) -> Iterator[None]:
    """Exit 1 with :func:`redis_problem`'s one line on a Redis error inside the block."""
    try:
        yield
    except redis.RedisError as e:
        fail(redis_problem(e, url))


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


def age(seconds: float | None) -> str:
    """A duration as people read an age: ``45s``, ``12m``, ``3.5h``, ``2.0d`` (``-``: none)."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"
