"""A real headless Chromium driven over the DevTools protocol (its pipe: no extra package).

Tests open a page at a given window size, wait for a condition the page reaches by itself,
and read back what a person would see: text, and where each element is laid out.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

FLAGS = (
    "--headless",
    "--no-sandbox",
    # One process fewer to launch: under load the zygote's and GPU process's start-up
    # pings time out and Chromium exits with "GPU process isn't usable".
    "--no-zygote",
    "--in-process-gpu",
    "--disable-gpu",
    "--disable-software-rasterizer",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


class Browser:
    """One Chromium process; ``open`` a page, then ``wait_for`` and ``evaluate`` in it."""

    def __init__(self, user_data_dir: Path, timeout: float = 60.0) -> None:
        assert CHROMIUM is not None
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        # Chromium reads commands on fd 3 and writes replies on fd 4.
        redirect = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}'
        self.proc = subprocess.Popen(
            ["bash", "-c", redirect, CHROMIUM, *FLAGS, "--remote-debugging-pipe",
             f"--user-data-dir={user_data_dir}", "about:blank"],
            pass_fds=(to_chrome_r, from_chrome_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.timeout = timeout
        self._buf = b""
        self._id = 0
        self.session: str | None = None

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End Chromium (the process this object started)."""
        try:
            self.send("Browser.close", page=False)
        except (OSError, TimeoutError, RuntimeError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self._w)
        os.close(self._r)

    def open(self, url: str, width: int, height: int) -> None:
        """A new tab of ``width`` x ``height`` CSS pixels (a phone's when narrow) on ``url``."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, page=False)
        attached = self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, page=False
        )
        self.session = attached["sessionId"]
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 700}
        self.send("Emulation.setDeviceMetricsOverride", metrics)
        self.send("Page.navigate", {"url": url})
        self.wait_for("location.href !== 'about:blank' && document.readyState === 'complete'")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-able)."""
        reply = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression!r} threw: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def screenshot(self, path: Path) -> None:
        """Save what the open tab shows, top to bottom, as a PNG (to look at by eye)."""
        shot = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        Path(path).write_bytes(base64.b64decode(shot["data"]))

    def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"the page never made {expression!r} true")
            time.sleep(0.2)

    def send(self, method: str, params: dict | None = None, page: bool = True) -> dict:
        """One DevTools command (to the open tab unless ``page`` is False); its result."""
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if page:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._next(deadline)
            if reply.get("id") != self._id:
                continue  # an event, or a reply from another session
            if "error" in reply:
                raise RuntimeError(f"{method}: {reply['error']}")
            return reply["result"]

    def _next(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer")
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                raise RuntimeError(f"Chromium exited ({self.proc.poll()})")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)
