"""Coalescing of concurrent ``find`` requests to the same peer into one batched RPC.

Lookups for different keys that run at the same time (``get_many``, ``store_many``, several
averagers) usually ask the same peers first: they start from the same routing table. Each
lookup asks the batcher for one key; requests for one peer that arrive within the same
scheduling tick travel as one ``find`` with many keys, and every waiter gets its own result.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable

import trio
import trio.lowlevel

from dht.kademlia.protocol import FindResult
from dht.kademlia.routing import Contact

SendFn = Callable[[Contact, list[int], int, bool], Awaitable[list[FindResult[Contact]] | None]]

MAX_KEYS_PER_BATCH = 16  # keeps batched replies far below the message size limit


class _Batch:
    def __init__(self, contact: Contact, values: bool):
        self.contact = contact
        self.values = values  # one flag per RPC: lookups for peers only batch apart
        self.keys: list[int] = []
        self.index: dict[int, int] = {}
        self.count = 0
        self.sealed = False
        self.done = trio.Event()
        self.results: list[FindResult[Contact]] | None = None


class FindBatcher:
    def __init__(self, send: SendFn, max_keys: int = MAX_KEYS_PER_BATCH):
        self._send = send
        self.max_keys = max_keys
        self._open: dict[Hashable, _Batch] = {}
        self.requests_sent = 0
        self.keys_sent = 0

    async def find(
        self, nursery: trio.Nursery, contact: Contact, key_id: int, count: int, values: bool = True
    ) -> FindResult[Contact] | None:
        """Ask ``contact`` about ``key_id`` (``values=False``: its nearest peers only); None
        if the peer failed to answer."""
        slot = (contact.peer_id, values)
        batch = self._open.get(slot)
        if batch is None or batch.sealed or len(batch.keys) >= self.max_keys:
            batch = self._open[slot] = _Batch(contact, values)
            nursery.start_soon(self._flush, batch)  # in the node's nursery: waiters may leave
        if key_id not in batch.index:
            batch.index[key_id] = len(batch.keys)
            batch.keys.append(key_id)
        batch.count = max(batch.count, count)
        await batch.done.wait()
        return None if batch.results is None else batch.results[batch.index[key_id]]

    async def _flush(self, batch: _Batch) -> None:
        try:
            await (
                trio.lowlevel.checkpoint()
            )  # let the lookups scheduled in this tick join the batch
            batch.sealed = True
            slot = (batch.contact.peer_id, batch.values)
            if self._open.get(slot) is batch:
                del self._open[slot]
            self.requests_sent += 1
            self.keys_sent += len(batch.keys)
            batch.results = await self._send(batch.contact, batch.keys, batch.count, batch.values)
        finally:
            batch.sealed = True
            batch.done.set()
