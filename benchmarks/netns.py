"""What the namespace test beds (wan_testbed.py, nat_testbed.py) share: running ``ip``/``tc``/
``nft`` commands, creating namespaces, starting processes inside them, and tearing it all down.

Every namespace a test bed creates and every process it starts is recorded, so teardown can
kill the processes first (nothing keeps a namespace alive) and then delete the namespaces,
which deletes the veth ends inside them.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["NamespaceTestbed", "run_command", "unavailable_reason"]

logger = logging.getLogger(__name__)


def run_command(
    argv: Sequence[str],
    error: type[Exception],
    check: bool = True,
    input_text: str | None = None,
) -> subprocess.CompletedProcess:
    """Run a set-up command; with ``check``, a failure raises ``error`` naming the command."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, input=input_text)
    if check and proc.returncode != 0:
        raise error(f"`{' '.join(argv)}` failed (rc={proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason(
    tools: dict[str, str], probe: Callable[[str], str | None] | None = None
) -> str | None:
    """``None`` if namespaces with a veth pair work here and ``tools`` ({command: what
    installs it}) are installed, else why not; ``probe(namespace)`` checks more (its answer is
    the reason) inside a scratch namespace that has a veth pair p0/p1."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux"
    for tool, package in {"ip": "iproute2", **tools}.items():
        if shutil.which(tool) is None:
            return f"`{tool}` ({package}) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (or CAP_NET_ADMIN)"
    name = f"nsprobe-{uuid.uuid4().hex[:8]}"
    try:
        proc = run_command(["ip", "netns", "add", name], RuntimeError, check=False)
        if proc.returncode != 0:
            return f"`ip netns add` is not permitted here: {proc.stderr.strip()}"
        proc = run_command(
            ["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
            RuntimeError,
            check=False,
        )
        if proc.returncode != 0:
            return f"veth pairs are not available: {proc.stderr.strip()}"
        return probe(name) if probe is not None else None
    finally:
        run_command(["ip", "netns", "del", name], RuntimeError, check=False)


class NamespaceTestbed:
    """Base of a test bed: the namespaces it created and the processes it started."""

    error: type[Exception] = RuntimeError  # what a failed set-up command raises

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []

    def _run(
        self, argv: Sequence[str], check: bool = True, input_text: str | None = None
    ) -> subprocess.CompletedProcess:
        return run_command(argv, self.error, check, input_text)

    def _add_namespace(self, ns: str) -> None:
        """Create ``ns`` (recorded for teardown) with its loopback up."""
        self._run(["ip", "netns", "add", ns])
        self._created.append(ns)
        self._run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _spawn(self, ns: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``ns``; killed at teardown if still running."""
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def _run_in(self, ns: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion inside ``ns``."""
        kwargs.setdefault("timeout", 600)
        return subprocess.run(["ip", "netns", "exec", ns, *argv], **kwargs)

    name = "test bed"  # in the error when it cannot be set up here

    def _unavailable(self) -> str | None:
        """Why this test bed cannot run here (None: it can)."""
        return None

    def _setup(self) -> None:
        raise NotImplementedError

    def _describe(self) -> str:
        """One line for the log once it is up."""
        return self.name

    def __enter__(self) -> Any:
        reason = self._unavailable()
        if reason is not None:
            raise self.error(f"{self.name} unavailable: {reason}")
        try:
            self._setup()
        except BaseException:
            self._teardown()
            raise
        logger.info("%s", self._describe())
        return self

    def _teardown(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    logger.warning("process %d in the test bed did not exit after kill", proc.pid)
        self._procs.clear()
        for ns in reversed(self._created):
            proc = self._run(["ip", "netns", "del", ns], check=False)
            if proc.returncode != 0:
                logger.warning("could not delete namespace %s: %s", ns, proc.stderr.strip())
        self._created.clear()

    def __exit__(self, *exc: object) -> None:
        self._teardown()
