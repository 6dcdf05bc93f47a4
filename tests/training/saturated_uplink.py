"""What a saturated home uplink does to a training mode's rounds, staged for the tests: every
peer's first all-reduce runs out of time, and the DHT reads after a failed round come back
empty (test_diloco.py and test_sync_mode.py, the retry after a failed round with company)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest


def first_rounds_run_out(monkeypatch: pytest.MonkeyPatch) -> set[Any]:
    """Each peer's first all-reduce gets 1 ms (its link cannot carry it in time); returns the
    set that fills with the peers it happened to."""
    from moshpit.averaging.allreduce import AllReduceService

    real_run = AllReduceService.run
    ran_out: set[Any] = set()

    async def first_round_runs_out(self: Any, group: Any, *args: Any, **kwargs: Any) -> Any:
        me = self.host.peer_id
        if me not in ran_out:
            ran_out.add(me)
            kwargs["timeout"] = 1e-3
        return await real_run(self, group, *args, **kwargs)

    monkeypatch.setattr(AllReduceService, "run", first_round_runs_out)
    return ran_out


def forced_views_come_back_empty(monkeypatch: pytest.MonkeyPatch, modes: list[Any]) -> None:
    """The read a mode forces after a failed round lists nobody (timed out, or partial)."""
    for mode in modes:
        real_view = mode._view

        def view(force: bool = False, real_view: Any = real_view) -> Any:
            seen = real_view(force)
            return dataclasses.replace(seen, peers=[]) if force else seen

        monkeypatch.setattr(mode, "_view", view)
