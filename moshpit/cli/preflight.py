"""Checks a peer runs before it joins the swarm: can it write its checkpoints and its key file,
and is its port free?

Each failure is a :class:`PreflightError` with one line a user can act on (the CLI prints it
and exits 2). Found later, the same faults would cost a join, a restore and minutes of
training whose checkpoints all fail (a read-only directory), or a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["PreflightError", "check_identity_path", "check_ports_free", "check_writable_dir"]


class PreflightError(Exception):
    """A path or port this peer was given cannot work (bad input, exit status 2)."""


def _probe_write(directory: Path) -> None:
    """Create and remove a small file in ``directory`` (as root, permission bits say nothing:
    a read-only mount or a full disk only shows when writing)."""
    fd, name = tempfile.mkstemp(prefix=".moshpit-probe-", dir=directory)
    try:
        os.write(fd, b"moshpit")
        os.fsync(fd)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name)


def check_writable_dir(path: str | os.PathLike[str], option: str) -> None:
    """``path`` exists as a directory (created if missing) and accepts a new file."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise PreflightError(f"{option} {directory} exists and is not a directory") from None
    except OSError as e:
        raise PreflightError(f"cannot create {option} {directory}: {e.strerror or e}") from None
    try:
        _probe_write(directory)
    except OSError as e:
        hint = "free some space" if e.errno == errno.ENOSPC else f"give a writable {option}"
        raise PreflightError(
            f"{option} {directory} is not writable ({e.strerror or e}): {hint}"
        ) from None


def check_identity_path(path: str | os.PathLike[str] | None) -> None:
    """An existing key file is readable; a missing one can be created in its directory."""
    if path is None:
        return
    key = Path(path)
    if key.is_dir():
        raise PreflightError(f"--identity {key} is a directory; give a key file's path")
    if key.exists():
        try:
            with open(key, "rb") as f:
                f.read(1)
        except OSError as e:
            raise PreflightError(f"cannot read --identity {key}: {e.strerror or e}") from None
        return
    try:
        key.parent.mkdir(parents=True, exist_ok=True)
        _probe_write(key.parent)
    except OSError as e:
        raise PreflightError(
            f"cannot create --identity {key} ({e.strerror or e}): give a path in a writable "
            "directory"
        ) from None


def listen_failure(error: OSError) -> str:
    """Why listening failed, in words a user can act on."""
    if error.errno == errno.EADDRINUSE:
        return "another process is using that port: stop it or pick another port"
    return error.strerror or str(error)


def check_ports_free(maddrs: Iterable[Any]) -> None:
    """Every ``/ip4|ip6/<addr>/tcp/<port>`` with a fixed port can be bound now."""
    for maddr in maddrs:
        text = str(maddr)
        parts = text.strip("/").split("/")
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp":
            continue
        try:
            port = int(parts[3])
        except ValueError:
            continue
        if port == 0:
            continue
        family = socket.AF_INET if parts[0] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((parts[1], port))
            except OSError as e:
                raise PreflightError(f"cannot listen on {text}: {listen_failure(e)}") from None
