"""The chunks of a state served from memory: a peer without a ``checkpoint_dir`` is a donor too.

Without it, a DiLoCo peer that missed an outer step had nobody to load the swarm's state from
when no peer of the run had a checkpoint directory (an averager embedded in someone's training
loop, the LM benchmark): it waited ``load_state_timeout``, stepped alone, and its parameters
differed from the swarm's for good. With :class:`MemoryChunks`, every such peer keeps the
state of its last checkpoint-cadence epoch (``checkpoint_every_epochs``, ``_seconds``) as one
frozen CPU copy and serves it like a checkpoint. The cost is that copy (parameters and
optimizer statistics) and hashing it once per served epoch, the same work a disk checkpoint
does minus the writes.
"""

from __future__ import annotations

__all__ = ["MemoryChunks"]


class MemoryChunks:
    """The one state a peer serves from memory: ``digest -> bytes`` (a ``ChunkSource``).

    :meth:`replace` swaps the whole mapping at once: a reader in another thread sees the old
    state or the new one, never a mix, and a chunk of a state no longer served reads as None
    (the downloader asks another donor). The views alias a frozen snapshot that nothing else
    writes to.
    """

    def __init__(self) -> None:
        self._chunks: dict[bytes, memoryview] = {}

    def replace(self, chunks: dict[bytes, memoryview]) -> None:
        self._chunks = dict(chunks)

    def read_chunk(self, digest: bytes) -> bytes | None:
        view = self._chunks.get(digest)
        return None if view is None else bytes(view)
