"""Switching the loaded model of a worker of several (``mlxq worker --model A --model B``):
the worker loop's side.

Each pass the loop asks :meth:`ModelSwitcher.holding`. It looks at every served queue's
waiting jobs (at once when idle, every ``LOOK_INTERVAL_S`` while jobs run) and asks
:class:`~mlxq.worker.model_choice.ModelChoice` whether to switch. Once it has decided, the
worker takes no new jobs; when the running ones are finished and written, the next model is
built on the MLX thread (``Setup.switch_to``: the engine and its KV cache freed, weights
loaded unless kept) while the loop goes on heartbeating and publishing; then pulls resume
from the new model's queues. A job is never dropped or run twice by a switch: none is held
while it happens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from typing import TYPE_CHECKING, Protocol

import redis

from mlxq.broker.rq_store import lanes
from mlxq.errors import one_line
from mlxq.wire import ModelInfo
from mlxq.worker.config import WorkerConfig
from mlxq.worker.model_choice import ModelChoice, Switch

if TYPE_CHECKING:
    from mlxq.worker.reporting import Reporter


class Loader(Protocol):
    """What builds the next model's engine (the launcher's ``Setup``): its configuration
    is the loaded model's once a switch is done."""

    config: WorkerConfig | None

    def switch_to(self, model: str) -> Future[ModelInfo]:
        """Build ``model``'s engine on the MLX thread, in place of the running one."""
        ...


class Host(Protocol):
    """What the switcher needs of the worker it switches: what it holds, where it pulls
    from, the model it names in results, and where switches are reported."""

    name: str
    connection: redis.Redis
    model_name: str
    reporter: Reporter | None

    @property
    def jobs_held(self) -> int:
        """Jobs in flight or with results still owed to Redis."""
        ...

    def pull_only(self, queues: Sequence[str]) -> None:
        """Take jobs only from these of its queues from now on."""
        ...


log = logging.getLogger("mlxq.worker")

LOOK_INTERVAL_S = 0.5  # while jobs run, how often the queues are looked at
LOAD_WAIT_S = 0.1  # a pass's wait for a loading model (the loop heartbeats in between)


class ModelSwitcher:
    """Which model a worker of several runs, and the switches between them."""

    def __init__(
        self, setup: Loader, queues: dict[str, tuple[str, ...]], min_seconds: float
    ) -> None:
        """``queues``: the queues each model pulls from when loaded (``queues_by_model``);
        the first loaded model is ``setup.config``'s."""
        assert setup.config is not None
        self.setup, self.queues = setup, queues
        self.choice = ModelChoice(list(queues), setup.config.model, min_seconds, time.monotonic())
        every = [set(qs) for qs in queues.values()]
        self.shared = set.intersection(*every)  # served by whichever model is loaded
        self.names = list(dict.fromkeys(q for qs in queues.values() for q in qs))
        self.target: Switch | None = None
        self.loading: Future[ModelInfo] | None = None
        self._load_started = self._last_look = 0.0

    @property
    def active(self) -> str:
        """The model loaded now (or being unloaded, while a switch is under way)."""
        return self.choice.active

    @property
    def busy(self) -> bool:
        """Whether a switch is under way (decided, or loading)."""
        return self.target is not None

    def start(self, worker: Host) -> None:
        """Point the worker's pulls at the loaded model's queues."""
        worker.pull_only(self.queues[self.active])

    def holding(self, worker: Host) -> bool:
        """One pass of the worker's loop: True while it must take no new jobs."""
        if self.loading is not None:
            return self._wait_loaded(worker)
        if self.target is None and not self._look(worker):
            return False
        if worker.jobs_held:
            return True  # the running jobs finish, and are written, first
        assert self.target is not None
        self._load_started = time.monotonic()
        self.loading = self.setup.switch_to(self.target.to)
        return True

    def _look(self, worker: Host) -> bool:
        """Read the queues and decide; True when a switch was decided."""
        if worker.jobs_held and time.monotonic() - self._last_look < LOOK_INTERVAL_S:
            return False
        self._last_look = time.monotonic()
        depth = lanes.waiting(worker.connection, self.names)  # RQ lists and batches' lanes
        waiting = {
            m: sum(depth[q] for q in qs if q not in self.shared) for m, qs in self.queues.items()
        }
        shared = sum(depth[q] for q in self.shared)
        self.target = self.choice.decide(time.monotonic(), waiting, shared)
        if self.target is not None:
            log.debug(
                "Worker %s: switching to %s once its %d running jobs finish: %s",
                worker.name,
                self.target.to,
                worker.jobs_held,
                self.target.why,
            )
        return self.target is not None

    def _wait_loaded(self, worker: Host) -> bool:
        """Wait a little for the next model; once it runs, pull for it (and say so)."""
        assert self.loading is not None and self.target is not None
        wait_for([self.loading], timeout=LOAD_WAIT_S)
        if not self.loading.done():
            return True
        loading, switch = self.loading, self.target
        self.loading = self.target = None
        try:
            loading.result()
        except Exception as e:  # nothing is held: the worker exits saying why
            raise RuntimeError(
                f"could not switch to model {switch.to}: {one_line(e)} (its jobs wait for "
                "another worker; fix the model, or serve it elsewhere)"
            ) from e
        seconds = time.monotonic() - self._load_started
        old, config = self.active, self.setup.config
        assert config is not None
        self.choice.switched(switch.to, time.monotonic())
        worker.model_name = config.model
        self.start(worker)
        if worker.reporter is not None:
            worker.reporter.switched(old, switch.to, config.claimed_bytes, seconds)
        log.info(
            "Worker %s: switched model from %s to %s in %.1fs: %s",
            worker.name,
            old,
            switch.to,
            seconds,
            switch.why,
        )
        return False
