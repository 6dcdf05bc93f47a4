"""The adaptive grid's reads of DHT keys: how many peers of our schema are declared under a
key, and the look a new or stranded peer takes before it declares (``GroupKeyManager``
decides; this module only reads). Kept apart from ``averager.py``, which runs the step."""

from __future__ import annotations

import trio

from dht.p2p import PeerID
from moshpit.averaging.averager_services import CountingBackend
from moshpit.averaging.group_keys import GroupKeyManager


async def count_declared(
    backend: CountingBackend,
    key: str,
    schema: bytes | None,
    me: PeerID,
    read_timeout: float,
    out: list[int],
    *,
    looking_now: bool = False,
    with_us: bool = False,
) -> None:
    """Distinct peers of ``schema`` declared under ``key``, appended to ``out`` (nothing on a
    timeout). ``looking_now``: only those still looking (a withdrawn declaration of a round
    that ended is kept until it expires, up to ``matchmaking_timeout`` later); ``with_us``:
    and us, as ``CountingBackend.take_count`` counts."""
    with trio.move_on_after(read_timeout):
        found = await backend.list_candidates(key)
        peers = {
            c.peer
            for c in found
            if (schema is None or c.schema == schema) and (c.looking or not looking_now)
            and c.peer != me
        }  # fmt: skip
        out.append(len(peers) + 1 if with_us else len(peers))


async def follow_the_swarm(
    keys: GroupKeyManager,
    backend: CountingBackend,
    key: str,
    longer_key: str,
    schema: bytes | None,
    me: PeerID,
    read_timeout: float,
    deadline: float,
) -> bool:
    """Read our ``key``, ``longer_key`` and ``keys.other_longer_keys()`` before declaring;
    True if ``keys`` moved to a longer one (nobody else under ours, a group's worth under
    it: ``GroupKeyManager.follow_longer_now``). All count the peers looking now: keys change
    every round, so the records a round left under a key name peers that have moved on."""
    own: list[int] = []
    candidates = [longer_key, *keys.other_longer_keys()]
    counts: list[list[int]] = [[] for _ in candidates]
    with trio.move_on_at(deadline):
        async with trio.open_nursery() as reads:
            reads.start_soon(
                lambda: count_declared(
                    backend, key, schema, me, read_timeout, own, looking_now=True, with_us=True
                )
            )
            for candidate, count in zip(candidates, counts, strict=True):
                reads.start_soon(
                    lambda c=candidate, out=count: count_declared(
                        backend, c, schema, me, read_timeout, out, looking_now=True
                    )
                )
    found = [(c[0], k) for c, k in zip(counts, candidates, strict=True) if c]
    if not own or not found:
        return False  # the reads timed out: declare under our key as usual
    most, best = max(found)  # the most peers looking: room for us, most likely
    return keys.follow_longer_now(most, own[0], best)
