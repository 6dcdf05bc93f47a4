"""A headless chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
JSON messages separated by NUL bytes on file descriptors 3 and 4), for the dashboard's
browser tests and benchmarks/bench_dashboard.py. Needs nothing but the system's chromium
(Debian: ``apt-get install chromium``); no websocket library, no driver download.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
EXEC_ON_3_AND_4 = """
import fcntl, os, sys
# out of the way first (either may be 3 or 4 already), then onto 3 and 4
high = [fcntl.fcntl(int(fd), fcntl.F_DUPFD, 10) for fd in sys.argv[1:3]]
os.dup2(high[0], 3)
os.dup2(high[1], 4)
os.execv(sys.argv[3], sys.argv[3:])
"""


def find_chromium() -> str | None:
    """The browser's path (``$CHROMIUM`` first), or None."""
    wanted = os.environ.get("CHROMIUM")
    if wanted:
        return shutil.which(wanted)
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless browser with one page. Use as a context manager."""

    def __init__(self, executable: str, *, width: int = 1280, height: int = 900) -> None:
        self.width, self.height = width, height
        self._profile = tempfile.TemporaryDirectory(prefix="moshpit-chromium-")
        # MOSHPIT_CHROMIUM_LOG=path keeps the browser's stderr (why it did not start)
        log = os.environ.get("MOSHPIT_CHROMIUM_LOG")
        self._log = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        args = [
            executable,
            "--headless",
            "--no-sandbox",  # tests run as root in CI
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
            f"--user-data-dir={self._profile.name}",
            f"--window-size={width},{height}",
            "about:blank",
        ]
        # a tiny exec wrapper puts our pipe ends on the descriptors 3 and 4 chromium expects
        # (a shell cannot: dash takes only one-digit descriptors in redirections)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", EXEC_ON_3_AND_4, str(to_browser_r), str(from_browser_w), *args],
            pass_fds=(to_browser_r, from_browser_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self.session: str | None = None
        try:
            targets = self.call("Target.getTargets", timeout=30)["targetInfos"]
            page = next(t for t in targets if t["type"] == "page")
            self.session = self.call(
                "Target.attachToTarget", {"targetId": page["targetId"], "flatten": True}
            )["sessionId"]
            self.call("Page.enable")
            self.call("Runtime.enable")
            self.call(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            )
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ protocol

    def call(
        self, method: str, params: dict[str, Any] | None = None, *, timeout: float = 20.0
    ) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if self.session is not None and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self._events = (self._events + [reply])[-200:]

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the browser did not answer in time")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise BrowserError("the browser exited")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    # ------------------------------------------------------------------ page

    def navigate(self, url: str, timeout: float = 20.0) -> None:
        self._events.clear()
        self.call("Page.navigate", {"url": url}, timeout=timeout)
        self.wait_for("document.readyState === 'complete'", timeout=timeout)

    def evaluate(self, expression: str, timeout: float = 20.0) -> Any:
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            timeout=timeout,
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, poll: float = 0.2) -> Any:
        """Evaluate ``expression`` until it is truthy; its value. TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout:.0f}s: {expression}")
            time.sleep(poll)

    def screenshot(self, path: Path | str) -> bytes:
        """A PNG of the whole page (beyond the window's height), written to ``path``."""
        metrics = self.call("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        height = max(self.height, int(size["height"]))
        data = self.call(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": self.width, "height": height, "scale": 1},
            },
            timeout=30,
        )["data"]
        png = base64.b64decode(data)
        Path(path).write_bytes(png)
        return png

    def console_errors(self) -> list[str]:
        """Exceptions the page threw (Runtime.exceptionThrown events seen so far)."""
        return [
            json.dumps(e["params"]["exceptionDetails"])[:500]
            for e in self._events
            if e.get("method") == "Runtime.exceptionThrown"
        ]

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.session = None
                self.call("Browser.close", timeout=5)
            except (OSError, TimeoutError, BrowserError):
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        self._profile.cleanup()
        if self._log is not subprocess.DEVNULL:
            self._log.close()  # type: ignore[union-attr]

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
