"""The errors a command meets, in one table: its exit status and the one line a user reads.

Exit status 2 is bad input (an address, a path, an option: fix the command line), 1 a run that
could not go on (nobody to join, a key or directory held by another process, a state this
model cannot use). Each line says what to do. The table is ordered: the first type an error
is an instance of decides (subclasses before their bases).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dht import BootstrapError
from dht.p2p.errors import IdentityError, MultiaddrError
from moshpit.cli.preflight import PreflightError, listen_failure
from moshpit.training.errors import CheckpointError, StateError, StateMismatchError

__all__ = ["Failure", "failure_of", "JOIN_FAILURES"]


@dataclass(frozen=True)
class Failure:
    """How a command ends on an error: its exit status and the line it prints."""

    status: int
    line: str


# (error type, exit status, the line for it; ``where`` says what the command was doing)
_Line = Callable[[Any, dict[str, Any]], str]
_TABLE: Sequence[tuple[type[BaseException], int, _Line]] = (
    (MultiaddrError, 2, lambda e, where: f"bad address: {e}"),
    (PreflightError, 2, lambda e, where: str(e)),
    (
        BootstrapError,
        1,
        lambda e, where: f"could not join through {' '.join(where.get('initial_peers', []))}: {e}",
    ),
    (IdentityError, 1, lambda e, where: str(e)),
    (
        StateMismatchError,
        1,
        lambda e, where: (
            f"the swarm of run {where.get('run_id')!r} trains another model: {e} (pick another "
            "--run-id, or run the same model and options as its peers)"
        ),
    ),
    (CheckpointError, 1, lambda e, where: str(e)),
    (StateError, 1, lambda e, where: str(e)),  # e.g. a state that went NaN for good
    (
        OSError,
        1,
        lambda e, where: (
            f"cannot listen on {' '.join(where.get('host_maddrs', []))}: {listen_failure(e)}"
        ),
    ),
)

# what joining a swarm may raise (its OSError: a port taken since the check, or the network)
JOIN_FAILURES: tuple[type[BaseException], ...] = tuple(t for t, _, _ in _TABLE)


def failure_of(error: BaseException, **where: Any) -> Failure | None:
    """The exit status and line for ``error`` (None: not a failure the table knows)."""
    for kind, status, line in _TABLE:
        if isinstance(error, kind):
            return Failure(status, line(error, where))
    return None
