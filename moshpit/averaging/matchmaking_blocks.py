"""Who leads whom on a crowded key: the peers' total order, and blocks of one group each.

When more peers look under one key than fit in one group (the shared key of a swarm that has
not grown a grid yet, or an overfull grid line), asking "the earliest peer first" makes every
peer ask the same leader. It fills up, and the rest then try full leaders one by one, each a
dial and a round trip, while the peers they ask are busy asking someone else themselves. In a
simulation of 128 peers on one key with groups of 16, 10-33 peers were left alone every
round and up to half the groups were pairs.

With blocks, every peer ranks the looking peers it read and cuts the ranking into consecutive
blocks of ``target_group_size``. A block's earliest arrival leads it and asks nobody; the
others ask it first. Reads that differ a little still meet: a peer that is not a leader
redirects to the leader it follows, and the old order (every earlier peer, earliest first)
remains the fallback.

The rank is ``(bucket of the order, hash of bucket and peer, order, peer)``, which every peer
computes alike from the declarations. Peers that arrive in different buckets keep their
arrival order, so a late arrival lands in the last block and does not reshuffle the earlier
ones. Peers that arrive within one bucket (a swarm that steps together) are shuffled anew
every round; ranked by arrival alone they would form the same groups round after round (seen
in the same simulation: factors of 0.8-0.96 per round from round 4 on). The rank only sorts
peers into blocks: who may ask whom stays the arrival order, ``(order, peer)``. Used for
that as well, it cost a poll interval (0.25 s) whenever a later arrival ranked first and had
to wait for the earlier one's next read: an ADPSGD test with 3 peers ran 72 s instead of 38.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from moshpit.averaging.group_info import MODE_CLIENT

# seconds of arrival order that a round shuffles: wider than the spread of a swarm that steps
# together on one clock, narrower than the gap between a round's early and late arrivals
ORDER_RESOLUTION = 0.25
MAX_BUCKET = 2**62

Rank = tuple[int, bytes, float, bytes]
P = TypeVar("P", bound=Hashable)


def rank(order: float, peer: bytes) -> Rank:
    """The sort key of a declaration: earlier buckets first, shuffled inside a bucket.

    ``order`` comes from the network (finite, but any size): the bucket is clamped so that
    it always fits the 8 bytes hashed."""
    bucket = math.floor(max(-MAX_BUCKET, min(MAX_BUCKET, order / ORDER_RESOLUTION)))
    salt = bucket.to_bytes(8, "big", signed=True)
    shuffle = hashlib.blake2b(salt + peer, digest_size=8).digest()
    return (bucket, shuffle, order, peer)


@dataclass(frozen=True)
class Block(Generic[P]):
    """Our block of the ranking, as one read of the key showed it."""

    ranked: tuple[tuple[P, str], ...]  # its peers and their modes, us included, leader first
    basis: int  # how many looking peers that read showed

    @property
    def members(self) -> frozenset[P]:
        return frozenset(peer for peer, _ in self.ranked)

    def leader(self, passed_over: Collection[P] = ()) -> P | None:
        """Who leads it: its first peer that can lead (not client-mode) and was not passed
        over (gone, or it would not take us); None if nobody is left."""
        return next(
            (p for p, mode in self.ranked if mode != MODE_CLIENT and p not in passed_over), None
        )


def block_of(
    ranked: Sequence[tuple[P, str]],
    me: P,
    size: int,
    lead_order: Callable[[P], Any] | None = None,
) -> Block[P] | None:
    """Our block of ``ranked`` (looking peers and their modes, in rank order, us included),
    or None when everyone fits in one group (no blocks: the whole key is one group).

    ``lead_order``: who of the block leads first (the matchmaker passes the arrival order,
    which requests must follow); None keeps the rank order."""
    if len(ranked) <= size:
        return None
    index = next(i for i, (peer, _) in enumerate(ranked) if peer == me)
    start = index - index % size
    block = list(ranked[start : start + size])
    if lead_order is not None:
        block.sort(key=lambda entry: lead_order(entry[0]))
    return Block(ranked=tuple(block), basis=len(ranked))
