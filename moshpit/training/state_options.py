"""A ``TrainingStateAverager``'s own knobs as one validated value: ``StateAveragerOptions``.

``TrainingStateAverager(..., keep_checkpoints=3)`` and
``TrainingStateAverager(..., options=StateAveragerOptions(keep_checkpoints=3))`` build the same
thing. Either way the options are checked when the averager is made, with the option's name in
the message (a negative ``join_timeout`` fails there, not at the first round), and the
constructor reads typed fields instead of sorting a dozen keyword arguments from the inner
Averager's, which travel in the same call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moshpit.averaging.config import check_integer, check_seconds

__all__ = ["StateAveragerOptions"]


@dataclasses.dataclass(frozen=True)
class StateAveragerOptions:
    """What a :class:`~moshpit.TrainingStateAverager` checkpoints, averages and loads.

    - ``checkpoint_dir``: where :meth:`~moshpit.TrainingStateAverager.save_checkpoint` writes
      (and what this peer serves to joiners afterwards); None disables checkpoints and serving.
    - ``average_parameters``: whether a round averages the parameters.
    - ``average_optimizer_statistics``: whether a round averages the optimizer statistics: the
      floating-point per-parameter tensors of the parameter's shape (Adam's moments); scalar
      counters (Adam's ``step``) stay local but are saved and loaded with the state.
    - ``average_extra_tensors``: whether a round averages the floating-point extra tensors.
    - ``sync_on_start``: before the first round, load the swarm's newest state if a donor
      serves one newer than ours; a peer with fresh weights is thus never averaged in at full
      weight. Set False only if every peer starts from the same state by construction.
    - ``join_timeout``: how long (s) that first look for donors waits.
    - ``checkpoint_every_seconds``: write a checkpoint this often (in a background thread,
      from a snapshot taken on the training thread); None: only on request.
    - ``checkpoint_every_epochs``: also write one every this many epochs; None: never.
    - ``keep_checkpoints``: how many checkpoints stay on disk (older ones are deleted); a
      damaged newest one falls back to the next.
    - ``restore_checkpoint``: load the newest intact checkpoint of ``checkpoint_dir`` at start
      (a restarted peer resumes where it stopped).
    - ``serve_from_memory``: without a ``checkpoint_dir``, keep the state of the epochs a
      checkpoint would be written at (``checkpoint_every_*``) as one CPU copy and serve it to
      joiners and laggards, so a run without disks can still catch a peer up. It costs one
      copy of the state in memory and hashing it once per such epoch. False: a peer without
      a ``checkpoint_dir`` serves nothing.
    """

    checkpoint_dir: str | Path | None = None
    average_parameters: bool = True
    average_optimizer_statistics: bool = True
    average_extra_tensors: bool = True
    sync_on_start: bool = True
    join_timeout: float = 10.0
    checkpoint_every_seconds: float | None = None
    checkpoint_every_epochs: int | None = None
    keep_checkpoints: int = 2
    restore_checkpoint: bool = True
    serve_from_memory: bool = True

    def __post_init__(self) -> None:
        check_seconds("join_timeout", self.join_timeout, positive=False)
        check_seconds(
            "checkpoint_every_seconds", self.checkpoint_every_seconds, positive=False, optional=True
        )
        if self.checkpoint_every_epochs is not None:
            check_integer("checkpoint_every_epochs", self.checkpoint_every_epochs, minimum=1)
        check_integer("keep_checkpoints", self.keep_checkpoints, minimum=1)

    @classmethod
    def split(
        cls, base: StateAveragerOptions | None, keywords: Mapping[str, Any]
    ) -> tuple[StateAveragerOptions, dict[str, Any]]:
        """``base`` (or the defaults) with the ``keywords`` that name its fields on top, and
        the other keywords (the inner :class:`~moshpit.Averager`'s options)."""
        if base is None:
            base = cls()
        elif not isinstance(base, cls):
            raise TypeError(f"options must be a StateAveragerOptions, got {type(base).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        ours = {k: v for k, v in keywords.items() if k in known}
        rest = {k: v for k, v in keywords.items() if k not in known}
        return (dataclasses.replace(base, **ours) if ours else base), rest
