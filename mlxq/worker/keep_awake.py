"""Keeping a Mac from idle sleep while, and only while, its worker holds jobs.

A worker on a Mac nobody touches would otherwise idle-sleep mid-batch: its heartbeats stop,
other workers take its jobs back, and what it generated is lost. So while it holds jobs (in
flight, or results owed to Redis) it holds the assertion ``caffeinate -i`` takes, IOKit's
``PreventUserIdleSystemSleep``, named for the worker (``pmset -g assertions`` lists it),
and releases it when it goes idle and when it exits. Only idle sleep: a closed lid, the
Apple menu's Sleep or a low battery still sleep the Mac. ``mlxq worker --no-keep-awake``
(``keep_awake = false`` in a profile) turns it off; on other systems it does nothing.

Design: IOKit's ``IOPMAssertionCreateWithName`` / ``IOPMAssertionRelease`` through ctypes
(the type and name as CoreFoundation strings), not a ``caffeinate -i -w PID`` child. The
assertion belongs to this process: the OS (powerd) drops it when the process dies, SIGKILL
and crashes included, so nothing can outlive the worker, and there is no child to start,
reap or leave behind, and no fork in a process that runs MLX (:mod:`mlxq.worker.rq_worker`
never forks). The C interface is small and stable since macOS 10.6; every type is
declared (``restype`` too: a CFString pointer truncated to an int would crash), and a
failure to load or to take the assertion logs one warning and leaves the worker running,
just without it.

Test seam (tests only, not a setting): with ``MLXQ_KEEP_AWAKE_RECORD=/path/file`` set, a
worker whose keep-awake is on, on any system, appends ``hold <unix time>`` and
``release <unix time>`` lines to that file instead of touching IOKit, so a test on Linux
sees when the assertion would be held.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from pathlib import Path
from typing import Protocol

log = logging.getLogger("mlxq.worker")

RECORD_ENV = "MLXQ_KEEP_AWAKE_RECORD"  # tests only: see the module docstring
ASSERTION_TYPE = b"PreventUserIdleSystemSleep"  # kIOPMAssertionTypePreventUserIdleSystemSleep
LEVEL_ON = 255  # kIOPMAssertionLevelOn
UTF8 = 0x08000100  # kCFStringEncodingUTF8
IOKIT = "/System/Library/Frameworks/IOKit.framework/IOKit"
CORE_FOUNDATION = "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"


class Assertion(Protocol):
    """What :class:`KeepAwake` holds: ``acquire`` and ``drop`` raise OSError on failure."""

    def acquire(self) -> None: ...

    def drop(self) -> None: ...


class KeepAwake:
    """Holds ``assertion`` while busy; every call is idempotent and acts only on a change,
    so the loop can call :meth:`set` every pass. ``None``: does nothing (off, not macOS)."""

    def __init__(self, assertion: Assertion | None = None) -> None:
        self._assertion = assertion
        self._held = False

    @classmethod
    def for_worker(cls, enabled: bool, name: str) -> KeepAwake:
        """The worker's: IOKit's assertion on macOS, the test record where its variable is
        set, else (or when ``enabled`` is False) one that does nothing."""
        if not enabled:
            return cls(None)
        record = os.environ.get(RECORD_ENV)
        if record:
            return cls(Recorded(Path(record)))
        if sys.platform != "darwin":
            return cls(None)
        try:
            return cls(PowerAssertion(f"mlxq worker {name}: generating"))
        except (OSError, AttributeError) as e:
            log.warning("cannot keep this Mac awake while it works (IOKit: %s)", e)
            return cls(None)

    @property
    def held(self) -> bool:
        return self._held

    def set(self, busy: bool) -> None:
        """Hold while ``busy``, release otherwise."""
        if busy:
            self.hold()
        else:
            self.release()

    def hold(self) -> None:
        if self._held or self._assertion is None:
            return
        try:
            self._assertion.acquire()
        except OSError as e:  # the worker works on, as it would with --no-keep-awake
            log.warning("cannot keep this Mac awake while it works (%s); carrying on", e)
            self._assertion = None
            return
        self._held = True
        log.debug("idle sleep held off while jobs run")

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        assert self._assertion is not None
        try:
            self._assertion.drop()
        except OSError as e:  # (it goes with the process anyway)
            log.warning("could not release the idle-sleep assertion: %s", e)
            return
        log.debug("idle sleep allowed again")


class PowerAssertion:
    """IOKit's idle-sleep assertion through ctypes (macOS only: loading fails elsewhere)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._id: int | None = None
        cf = ctypes.CDLL(CORE_FOUNDATION)
        cf.CFStringCreateWithCString.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]
        cf.CFStringCreateWithCString.restype = ctypes.c_void_p
        cf.CFRelease.argtypes = [ctypes.c_void_p]
        cf.CFRelease.restype = None
        iokit = ctypes.CDLL(IOKIT)
        create = iokit.IOPMAssertionCreateWithName
        create.argtypes = [
            ctypes.c_void_p,  # CFStringRef AssertionType
            ctypes.c_uint32,  # IOPMAssertionLevel
            ctypes.c_void_p,  # CFStringRef AssertionName
            ctypes.POINTER(ctypes.c_uint32),  # IOPMAssertionID *
        ]
        create.restype = ctypes.c_int32  # IOReturn
        iokit.IOPMAssertionRelease.argtypes = [ctypes.c_uint32]
        iokit.IOPMAssertionRelease.restype = ctypes.c_int32
        self._cf, self._iokit = cf, iokit

    def acquire(self) -> None:
        kind = self._cf.CFStringCreateWithCString(None, ASSERTION_TYPE, UTF8)
        name = self._cf.CFStringCreateWithCString(None, self.name.encode(), UTF8)
        try:
            if not kind or not name:
                raise OSError("CFStringCreateWithCString failed")
            assertion_id = ctypes.c_uint32(0)
            rc = self._iokit.IOPMAssertionCreateWithName(
                kind, LEVEL_ON, name, ctypes.byref(assertion_id)
            )
            if rc != 0:
                raise OSError(f"IOPMAssertionCreateWithName returned {rc & 0xFFFFFFFF:#x}")
            self._id = assertion_id.value
        finally:  # the assertion keeps its own references
            for s in (kind, name):
                if s:
                    self._cf.CFRelease(s)

    def drop(self) -> None:
        if self._id is None:
            return
        rc = self._iokit.IOPMAssertionRelease(self._id)
        self._id = None
        if rc != 0:
            raise OSError(f"IOPMAssertionRelease returned {rc & 0xFFFFFFFF:#x}")


class Recorded:
    """Tests only (``MLXQ_KEEP_AWAKE_RECORD``): each hold and release as a line of ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def acquire(self) -> None:
        self._write("hold")

    def drop(self) -> None:
        self._write("release")

    def _write(self, what: str) -> None:
        with self.path.open("a") as f:
            f.write(f"{what} {time.time():.6f}\n")
