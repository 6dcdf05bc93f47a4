"""Each training mode's knobs as one validated value: ``SyncOptions``, ``LocalOptions`` and
``DiLoCoOptions``.

``Optimizer(mode="diloco", inner_steps=50)`` and ``Optimizer(mode=DiLoCoOptions(inner_steps=50))``
build the same thing; either way the options are checked when the Optimizer is made, with the
option's name in the message, and the mode's constructor reads typed fields instead of a
keyword soup. What can only be checked against the model or the swarm (fragments against the
parameter count, inner_steps against target_batch_size, a codec's name) stays in the mode.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from moshpit.averaging.config import check_integer, check_seconds

__all__ = ["DiLoCoOptions", "LocalOptions", "ModeOptions", "SyncOptions", "options_for"]


@dataclasses.dataclass(frozen=True)
class ModeOptions:
    """What every mode takes. ``checkpoint_every_epochs``: every this many epochs, write a
    checkpoint into the ``checkpoint_dir``, or without one serve the state from memory (what
    donors serve to joiners and laggards); None: only the Optimizer's
    ``checkpoint_every_seconds``."""

    mode: ClassVar[str] = ""
    checkpoint_every_epochs: int | None = 1

    def __post_init__(self) -> None:
        if self.checkpoint_every_epochs is not None:
            check_integer("checkpoint_every_epochs", self.checkpoint_every_epochs, minimum=1)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


@dataclasses.dataclass(frozen=True)
class SyncOptions(ModeOptions):
    """``mode="sync"``: ``refresh_period`` (s between two reads of the swarm's progress;
    default: the tracker's ``min_refresh_period``), ``round_timeout`` (s; default: the
    averager's own timeouts), ``compression`` (a codec), ``dgc`` with ``dgc_options`` (DGC then
    chooses the compression), ``delay_averaging`` (each round overlaps the next batch),
    ``serve_state`` (False: without a ``checkpoint_dir``, serve nothing, even with the
    Optimizer's ``serve_from_memory``; a peer that missed a round then has no donor)."""

    mode: ClassVar[str] = "sync"
    refresh_period: float | None = None
    round_timeout: float | None = None
    compression: Any = None
    dgc: bool = False
    dgc_options: dict[str, Any] | None = None
    delay_averaging: bool = False
    serve_state: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_seconds("refresh_period", self.refresh_period, positive=True, optional=True)
        check_seconds("round_timeout", self.round_timeout, positive=True, optional=True)
        if self.dgc and self.compression is not None:
            raise ValueError("dgc=True chooses its own compression; drop compression=")
        if not self.dgc and self.dgc_options:
            raise ValueError("dgc_options need dgc=True")


@dataclasses.dataclass(frozen=True)
class LocalOptions(ModeOptions):
    """``mode="local"``: ``average_every`` (the initial period H in steps), ``adaptive_period``
    with ``max_period``, ``calibration_rounds``, ``period_tolerance`` and ``period_growth``
    (see ``adaptive_period.py``), ``wait_for_rounds`` (False: averaging never stalls
    training), ``round_timeout`` (s), ``compression`` (None, "fp16", "8bit" or a dense
    codec)."""

    mode: ClassVar[str] = "local"
    average_every: int = 4
    adaptive_period: bool = True
    max_period: int = 64
    calibration_rounds: int = 3
    period_tolerance: float = 1.0
    period_growth: float = 2.0
    wait_for_rounds: bool = False
    round_timeout: float | None = None
    compression: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_integer("average_every", self.average_every, minimum=1)
        check_integer("max_period", self.max_period, minimum=1)
        check_seconds("round_timeout", self.round_timeout, positive=True, optional=True)


@dataclasses.dataclass(frozen=True)
class DiLoCoOptions(ModeOptions):
    """``mode="diloco"``: ``inner_steps`` (H; default 500, or unset when the Optimizer's
    ``target_batch_size`` sets swarm-wide epochs), ``outer_lr``, ``outer_momentum``,
    ``nesterov``, ``compression`` ("fp16", "8bit", "4bit", "topk", "sparse2bit", a codec, a
    ``TwoWayCompression`` or a ``GraVAC``) with ``topk_density`` (the share of values a
    member sends) and ``reducer_density`` (the share a reducer sends back of the summed
    part, default ``topk_density``; the sum of G members' parts holds up to G times as many
    values, and what is cut waits in the reducer's residual), ``round_timeout`` (s),
    ``refresh_period`` (s), streaming DiLoCo's ``fragments`` and ``overlap_steps``, and
    ``local_error_feedback``: after each round the inner loop restarts from ``θ`` minus what
    this peer's codec has not sent yet (its sender residual), which then travels in the next
    Δ instead of the codec's buffer; with top-k, the peer keeps its unsent progress.
    ``error_feedback_decay`` (β, default 1) multiplies a member's residual each round before
    it meets the next Δ: SparseLoCo's error feedback, which stands in for the outer momentum
    (with ``outer_momentum=0``, ``nesterov=False``, ``outer_lr=1``)."""

    mode: ClassVar[str] = "diloco"
    inner_steps: int | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compression: Any = None
    topk_density: float = 0.01
    reducer_density: float | None = None
    round_timeout: float | None = None
    refresh_period: float | None = None
    fragments: int = 1
    overlap_steps: int = 0
    local_error_feedback: bool = False
    error_feedback_decay: float = 1.0

    @classmethod
    def sparseloco(
        cls, group_size: int, topk_density: float = 0.01, **overrides: Any
    ) -> DiLoCoOptions:
        """SparseLoCo's settings (Sarfi et al., 2025) for groups of ``group_size``: the top
        ``topk_density`` of every 4096 values at 2 bits (``"sparse2bit"``), members' residuals
        decayed by 0.95 a round in place of the outer momentum, outer lr 1 without momentum,
        and reducers that send back all that the group's members can sum to (SparseLoCo
        all-gathers). ``overrides`` go on top (``inner_steps``, ``fragments``, ...)."""
        check_integer("group_size", group_size, minimum=1)
        _check_share("topk_density", topk_density)
        settings: dict[str, Any] = dict(
            compression="sparse2bit",
            topk_density=topk_density,
            reducer_density=min(1.0, group_size * topk_density),
            error_feedback_decay=0.95,
            outer_momentum=0.0,
            nesterov=False,
            outer_lr=1.0,
        )
        return cls(**{**settings, **overrides})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.inner_steps is not None:
            check_integer("inner_steps", self.inner_steps, minimum=1)
        ok = isinstance(self.outer_lr, (int, float)) and not isinstance(self.outer_lr, bool)
        if not ok or not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ValueError(f"outer_lr must be positive, got {self.outer_lr!r}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        _check_share("topk_density", self.topk_density)
        if self.reducer_density is not None:
            _check_share("reducer_density", self.reducer_density)
        check_integer("fragments", self.fragments, minimum=1)
        check_integer("overlap_steps", self.overlap_steps, minimum=0)
        if not isinstance(self.local_error_feedback, bool):
            raise TypeError(
                f"local_error_feedback must be a bool, not {self.local_error_feedback!r}"
            )
        check_seconds("round_timeout", self.round_timeout, positive=True, optional=True)
        check_seconds("refresh_period", self.refresh_period, positive=True, optional=True)
        decay = self.error_feedback_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay <= 1:
            raise ValueError(f"error_feedback_decay must be in [0, 1], got {decay!r}")
        if decay != 1 and self.local_error_feedback:
            raise ValueError(
                "error_feedback_decay has nothing to decay with local_error_feedback=True, "
                "which moves each round's unsent residual into the parameters; choose one"
            )


def _check_share(name: str, value: object) -> None:
    """A share of the values sent: a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


_BY_MODE: dict[str, type[ModeOptions]] = {
    cls.mode: cls for cls in (SyncOptions, LocalOptions, DiLoCoOptions)
}


def options_for(mode: str | ModeOptions, **overrides: Any) -> ModeOptions:
    """The options of ``mode`` (a mode name or a ``*Options`` value) with ``overrides`` on top.
    An option the mode does not take is a ``TypeError`` naming the ones it does."""
    if isinstance(mode, ModeOptions):
        cls: type[ModeOptions] = type(mode)
        base: ModeOptions | None = mode
    elif mode in _BY_MODE:
        cls, base = _BY_MODE[mode], None
    else:
        names = ", ".join(map(repr, _BY_MODE))
        raise ValueError(f"mode must be one of {names} or a mode's options; got {mode!r}")
    known = cls.field_names()
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise TypeError(
            f"unknown option(s) for mode={cls.mode!r}: {', '.join(unknown)}; "
            f"it takes: {', '.join(known)}"
        )
    if base is None:
        return cls(**overrides)
    return dataclasses.replace(base, **overrides) if overrides else base
