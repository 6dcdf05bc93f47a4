"""Butterfly all-reduce inside one group, over ``/moshpit/averaging/1.0.0`` streams.

Public API (stable; see docs/allreduce.md for the wire protocol and failure semantics)::

    service = AllReduceService(host)          # one per Host; registers the stream handler
    result = await service.run(
        group,                                # GroupInfo, identical on every member
        tensors,                              # this member's tensors (None for an aux member)
        weight=1.0,                           # this member's weight in the weighted mean
        compression=None,                     # TwoWayCompression | Codec | None
        timeout=30.0,                         # the round never takes longer than this
        sender_timeout=None,                  # reducer side: a sender stalled this long is left out
        reducer_timeout=None,                 # sender side: a reducer stalled this long is given up
        aggregation=None,                     # Aggregator (default: streaming weighted mean)
    )
    result.averaged                           # new tensors, same shapes/dtypes (None for aux)
    result.failed_senders, result.failed_reducers, result.excluded   # who failed, and why

``run`` never raises because of other peers: stalls, disconnects and bad input become entries in
the result, and parts that could not be averaged keep this member's local values. It raises
``ValueError``/``GroupInfoError`` for bad local arguments, and propagates cancellation.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from moshpit.averaging.group_info import GroupInfo

if TYPE_CHECKING:
    from compression import Codec, TwoWayCompression
    from dht.p2p import Host, P2PStream, PeerID
    from moshpit.averaging.aggregation import Aggregator

logger = logging.getLogger(__name__)

ALLREDUCE_PROTOCOL = "/moshpit/averaging/1.0.0"


@dataclass
class AllReduceResult:
    """What one member got out of a round.

    ``failed_senders``: members whose contribution to *this* member's part was (partly) missing.
    ``failed_reducers``: members whose part this member did not get back (it kept local values).
    ``excluded``: members left out for bad input / protocol violations, with the reason.
    ``deviation``: sum over parts of ``sum_i w_i ||x_i - mean||^2 / sum_i w_i`` (for adaptive
    averaging periods, ADPSGD); ``None`` when some part did not report it.
    """

    averaged: list[torch.Tensor] | None
    failed_senders: set[PeerID] = field(default_factory=set)
    failed_reducers: set[PeerID] = field(default_factory=set)
    excluded: dict[PeerID, str] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    deviation: float | None = None
    timed_out: bool = False

    @property
    def failed_peers(self) -> set[PeerID]:
        """Everyone who misbehaved in this round in any role (for H6 to avoid repeat offenders)."""
        return self.failed_senders | self.failed_reducers | set(self.excluded)


class AllReduceService:
    """Runs all-reduce rounds for one Host and routes incoming streams to them by group id."""

    def __init__(self, host: Host, *, protocol: str = ALLREDUCE_PROTOCOL) -> None:
        self.host = host
        self.protocol = protocol

    async def handle_stream(self, stream: P2PStream) -> None:
        """Serve one incoming stream (registered as the protocol's stream handler)."""
        raise NotImplementedError("work in progress (H5)")

    async def run(
        self,
        group: GroupInfo,
        tensors: Sequence[torch.Tensor] | None,
        *,
        weight: float = 1.0,
        compression: TwoWayCompression | Codec | None = None,
        timeout: float = 30.0,
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        aggregation: Aggregator | None = None,
    ) -> AllReduceResult:
        """Average ``tensors`` with the rest of ``group``; see the module docstring."""
        raise NotImplementedError("work in progress (H5)")

    def close(self) -> None:
        """Stop accepting streams (unregisters nothing the Host does not own)."""
