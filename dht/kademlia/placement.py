"""Placing records on their replicas: the write path behind ``DHTNode.store`` and republish.

A key's records go to its ``num_replicas`` nearest peers (this node among them when it is
one): one lookup per key, then one batched ``store`` RPC per peer. The records this node
wrote are remembered and re-placed every ``republish_interval`` until they expire or most
replicas call them outdated. The public calls (``store``, ``store_many``, ``republish``) are
the node's; this is how they reach the network, kept apart from the node's RPC plumbing.
"""

from __future__ import annotations

import logging
import math
import random
from typing import TYPE_CHECKING, Any

import trio

from dht.kademlia.clock import get_dht_time
from dht.kademlia.protocol import MAX_RECORDS_PER_STORE
from dht.kademlia.records import DHTRecord

if TYPE_CHECKING:
    from dht.kademlia.node import DHTNode

logger = logging.getLogger(__name__)

REPUBLISH_KEYS_PER_BATCH = 256  # keys looked up together in one republish batch
Named = tuple[Any, DHTRecord]  # (caller's name for a record, the record)


def check_republish_interval(interval: float | None) -> float | None:
    """``DHTNode(republish_interval=...)``: positive seconds, or None for never."""
    if interval is not None and not interval > 0:
        raise ValueError(f"republish_interval must be positive seconds or None, not {interval!r}")
    return interval


async def store_records(
    node: DHTNode, by_key: dict[int, list[Named]], patience: float | None = None
) -> dict[Any, bool]:
    """Store records written by this node (their origin) and remember them to republish.

    Returns ``{name: accepted by any replica}``.
    """
    if node.republish_interval is not None:
        now = get_dht_time()
        for key_id, entries in by_key.items():
            for _, record in entries:
                node.owned.add(key_id, record, now)
    tally = await place_records(node, by_key, patience)
    if node.republish_interval is not None:
        forget_superseded(node, by_key, tally)
    return {name: counts[0] > 0 for name, counts in tally.items()}


async def republish_loop(node: DHTNode) -> None:
    """Every ``republish_interval`` (+-10 % jitter, so peers do not act in lockstep)."""
    assert node.republish_interval is not None
    while True:
        await trio.sleep(node.republish_interval * random.uniform(0.9, 1.1))
        await node.republish()


async def republish(node: DHTNode) -> int:
    """``DHTNode.republish``: re-place the due records this node wrote; how many were sent."""
    interval = node.republish_interval or 60.0
    due = node.owned.due(get_dht_time(), interval / 2, interval / 10)
    if not due:
        return 0
    node.maintenance.republish_passes += 1
    node.maintenance.republished_records += len(due)
    by_key: dict[int, list[Named]] = {}
    for key_id, record in due:
        by_key.setdefault(key_id, []).append(((key_id, record.subkey), record))
    keys = list(by_key)
    for start in range(0, len(keys), REPUBLISH_KEYS_PER_BATCH):
        batch = {k: by_key[k] for k in keys[start : start + REPUBLISH_KEYS_PER_BATCH]}
        tally = await place_records(node, batch)
        forget_superseded(node, batch, tally)
    return len(due)


def forget_superseded(
    node: DHTNode, by_key: dict[int, list[Named]], tally: dict[Any, list[int]]
) -> None:
    """Stop republishing records most answering replicas call outdated: a newer record
    for the same key/subkey exists (written by us or anyone else)."""
    for key_id, entries in by_key.items():
        for name, record in entries:
            accepted, outdated = tally[name]
            if outdated > accepted and node.owned.discard(key_id, record):
                node.maintenance.superseded_records += 1
                logger.debug("no longer republishing %r: superseded", name)


async def place_records(
    node: DHTNode, by_key: dict[int, list[Named]], patience: float | None = None
) -> dict[Any, list[int]]:
    """Place valid records on their replicas: one lookup per key, one batched RPC per peer.

    Returns ``{name: [replicas that accepted, replicas that called it outdated]}``.
    """
    tally = {name: [0, 0] for entries in by_key.values() for name, _ in entries}
    plan: dict[Any, list[Named]] = {}
    local: list[Named] = []

    def count(name: Any, accepted: bool, reason: str | None) -> None:
        if accepted:
            tally[name][0] += 1
        elif reason is not None and reason.startswith("outdated"):
            tally[name][1] += 1

    async def place(key_id: int, entries: list[Named]) -> None:
        result = await node._lookups.lookup(
            key_id, beam_size=node.beam_size, mode="nearest", patience=patience
        )
        replicas = result.nearest[: node.num_replicas]
        if not node.client_mode:
            worst = (
                replicas[-1].node_id ^ key_id if len(replicas) >= node.num_replicas else math.inf
            )
            if node.node_id ^ key_id < worst:
                replicas = replicas[: node.num_replicas - 1]
                local.extend(entries)
        for contact in replicas:
            plan.setdefault(contact.peer_id, []).extend(entries)

    async with trio.open_nursery() as nursery:
        for key_id, entries in by_key.items():
            nursery.start_soon(place, key_id, entries)

    for name, record in local:
        accepted, reason = node._store_local(record)
        count(name, accepted, reason)
        if not accepted:
            logger.debug("local replica refused %r: %s", name, reason)

    async def send(peer_id: Any, entries: list[Named]) -> None:
        for start in range(0, len(entries), MAX_RECORDS_PER_STORE):
            chunk = entries[start : start + MAX_RECORDS_PER_STORE]
            results = await node._store_rpc(peer_id, [record for _, record in chunk])
            for (name, _), (accepted, reason) in zip(chunk, results, strict=True):
                count(name, accepted, reason)
                if not accepted and reason != "peer unreachable":
                    logger.debug("%s refused %r: %s", peer_id, name, reason)

    async with trio.open_nursery() as nursery:
        for peer_id, entries in plan.items():
            nursery.start_soon(send, peer_id, entries)
    return tally
