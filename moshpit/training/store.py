"""Checkpoints: a directory of content-addressed chunks plus manifests, committed atomically.

The directory's layout and file formats are ``store_format``'s (chunks named by their
SHA-256, small ones in packs, manifests named by their root, a checksummed ``LATEST``); this
module is the commit protocol on top of the chunks (``store_chunks``) and the durable writes
(``store_durable``); falling back to an older state when the newest is damaged is
``store_restore``'s. Every public name of those is importable from here.

A commit is a chain of write-new, fsync, rename steps: chunks, then the manifest, then
``LATEST``; a crash (or ``kill -9``) at any point leaves ``LATEST`` naming either the previous
or the new manifest, and everything that manifest names is already on disk. Old chunks are
garbage-collected only after the new ``LATEST`` is durable. Packs are invisible through the
API (:meth:`StateStore.read_chunk` etc. work by digest). On Linux a save flushes everything
with one ``syncfs`` instead of an fsync per file.

Everything read back is verified against its hash, so a damaged disk gives
:class:`CheckpointCorruptError` naming the tensor, never a silently wrong model.

One writer process per directory (several threads and several :class:`StateStore` objects of
one process may share it). Readers in other processes are fine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from moshpit.training.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ManifestError,
    NoCheckpointError,
)
from moshpit.training.manifest import (
    DEFAULT_CHUNK_BYTES,
    DTYPES,
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    ChunkRef,
    Manifest,
    TensorSpec,
    build_manifest,
    dtype_name,
    tensor_bytes,
)
from moshpit.training.store_chunks import ChunkStore
from moshpit.training.store_durable import (
    Buffer,
    batches,
    executor,
    fsync_dir,
    remove_if_stale_tmp,
    results,
    syncfs,
    syncfs_available,
    write_atomic,
)
from moshpit.training.store_format import (
    PACK_COUNT,
    PACK_ENTRY,
    PACK_MAGIC,
    STORE_FORMAT_VERSION,
    TMP_PREFIX,
    check_state_layout,
    chunk_sizes,
    format_latest,
    manifest_file_intact,
    read_latest,
    read_manifest,
)
from moshpit.training.store_restore import (
    RestoredState,
    intact_manifests,
    load_newest_intact,
)

__all__ = [
    "PACK_COUNT",  # the pack format, for tests that take packs apart
    "PACK_ENTRY",
    "PACK_MAGIC",
    "STORE_FORMAT_VERSION",
    "RestoredState",
    "StateStore",
    "load_newest_intact",
    "load_state",
    "save_state",
]

logger = logging.getLogger(__name__)


class StateStore(ChunkStore):
    """A checkpoint directory: chunks/<2 hex>/<64 hex> files named by SHA-256 (small ones in
    packs/), manifests/<root hex>, and a LATEST pointer file naming the committed root. Doubles
    as a donor's serving store.

    ``keep`` committed states are kept; chunks referenced by none of them are deleted on the
    next commit, except chunks :meth:`put_chunk` stored since (a download in progress).
    ``durable=False`` skips every fsync: still safe against a killed process (the page cache
    survives it), not against a power cut; meant for tests and scratch runs.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, keep: int = 2, durable: bool = True
    ) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1 (the committed state itself)")
        self.keep = keep
        super().__init__(directory, durable=durable)

    def __repr__(self) -> str:
        return f"StateStore({str(self.directory)!r}, keep={self.keep})"

    # ------------------------------------------------------------------ commits

    def save(self, manifest: Manifest, chunks: Mapping[bytes, bytes | memoryview]) -> None:
        """Write the chunks this store lacks (each verified), then commit ``manifest``."""
        with self._shared.commit_lock:
            history = self._history_for_write()
            refs = manifest.chunk_refs()
            self._refresh_packs()
            todo = [d for d in refs if not self._present(d, refs[d])]
            for digest in todo:
                if digest not in chunks:
                    raise CheckpointError(
                        f"chunk {digest.hex()} of the manifest is neither in the store nor in "
                        "the chunks given to save()"
                    )
            self._store_new(
                [chunks[d] for d in todo], manifest.chunk_bytes, [(d, refs[d]) for d in todo]
            )
            self._commit_locked(manifest, history)

    def commit(self, manifest: Manifest) -> None:
        """Commit a manifest whose chunks are all present already (a finished download)."""
        with self._shared.commit_lock:
            history = self._history_for_write()
            missing = self.missing_chunks(manifest)
            if missing:
                first = next(iter(missing)).hex()
                raise CheckpointError(
                    f"cannot commit state {manifest.root.hex()[:16]}: {len(missing)} of its "
                    f"chunks are not in {self.directory} (first: {first})"
                )
            self._commit_locked(manifest, history)

    def _commit_locked(
        self, manifest: Manifest, history: list[bytes], *, checked: bool = False
    ) -> None:
        """Chunks durable -> manifest durable -> LATEST replaced -> garbage collection.

        ``history`` is :meth:`_history_for_write`, read before any chunk was written.
        ``checked``: the caller built the manifest from tensors it validated (save_state).
        """
        root = manifest.root
        shared = self._shared
        if not checked:  # what cannot be read back must not be committed
            try:
                Manifest.from_bytes(manifest.to_bytes())
            except ManifestError as e:
                raise CheckpointError(f"this state cannot be checkpointed: {e}") from None
        elif len(manifest.to_bytes()) > MAX_MANIFEST_BYTES:
            raise CheckpointError(
                f"this state cannot be checkpointed: its manifest would be "
                f"{len(manifest.to_bytes())} bytes, over the {MAX_MANIFEST_BYTES}-byte limit "
                "(use a larger chunk_bytes)"
            )
        try:
            if self.durable and not shared.flushed_once:
                self._flush_everything()
            if self.durable:
                with shared.lock:
                    dirty, shared.dirty_dirs = shared.dirty_dirs, set()
                for _ in results([executor().submit(fsync_dir, d) for d in sorted(dirty)]):
                    pass
            write_atomic(self._manifests / root.hex(), [manifest.to_bytes()], self.durable)
            if self.durable:
                fsync_dir(self._manifests)
            history = [root] + [r for r in history if r != root]
            history = history[: self.keep]
            write_atomic(self._latest, [format_latest(history)], self.durable)
            if self.durable:
                fsync_dir(self.directory)
        except OSError as e:
            raise CheckpointError(f"cannot commit a checkpoint into {self.directory}: {e}") from e
        refs = manifest.chunk_refs()
        with self._shared.lock:
            self._shared.pending.difference_update(refs)
        logger.debug("committed state %s (epoch %d)", root.hex()[:16], manifest.epoch)
        try:
            self._collect_garbage(history, {root: manifest})
        except (OSError, CheckpointError) as e:  # the commit stands; leftovers go next time
            logger.warning("garbage collection in %s failed: %s", self.directory, e)

    def _flush_everything(self) -> None:
        """Make every chunk and pack in the directory durable, once per process: a killed
        writer's files are complete (renamed only when written) but maybe not on disk yet, and
        this process's saves reuse them."""
        if syncfs_available():
            syncfs(self.directory)
        else:  # files were fsynced before their rename; their directories may not have been
            dirs = [str(self._packs), *self.layout.chunk_dirs()]
            for _ in results([executor().submit(fsync_dir, d) for d in dirs]):
                pass
        self._shared.flushed_once = True

    def _history_for_write(self) -> list[bytes]:
        """The committed roots; when LATEST is absent or damaged, the intact manifests found
        in manifests/ (newest epoch first), so that a commit after a damaged LATEST does not
        garbage-collect the older states that still verify. A damaged LATEST is moved aside.

        A LATEST of a newer store format is never overwritten: that moshpit's checkpoints
        would become unreadable to it.
        """
        try:
            return self._read_latest()
        except NoCheckpointError:
            return intact_manifests(self.layout)[: self.keep]
        except CheckpointCorruptError as e:
            logger.warning("%s; the next commit replaces it (the damaged copy is kept)", e)
            self._set_aside(self._latest, "LATEST")
            return intact_manifests(self.layout)[: self.keep]

    def _collect_garbage(self, history: list[bytes], known: dict[bytes, Manifest]) -> None:
        """Delete manifests not in ``history``, chunks none of them reference (unless pending),
        packs with no such chunk, and tmp files whose writer is gone; repack packs that are
        mostly garbage."""
        live: set[bytes] = set()
        for root in history:
            manifest = known.get(root)
            if manifest is None:
                try:
                    manifest = self.load_manifest(root)
                except CheckpointError as e:
                    logger.warning("older checkpoint %s unreadable, not kept: %s", root.hex(), e)
                    continue
            live.update(manifest.chunk_refs())
        keep_names = {r.hex() for r in history}
        removed_chunks = removed_other = 0
        for entry in os.scandir(self._manifests):
            if entry.name.startswith(TMP_PREFIX):
                removed_other += remove_if_stale_tmp(entry.path)
            elif entry.name not in keep_names:
                if manifest_file_intact(entry.path, entry.name):
                    os.unlink(entry.path)
                else:
                    self._set_aside(entry.path, f"manifest-{entry.name}")
                removed_other += 1
        for entry in os.scandir(self.directory):
            if entry.name.startswith(TMP_PREFIX):
                removed_other += remove_if_stale_tmp(entry.path)
        for sub in os.scandir(self._chunks):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name = entry.name
                if name.startswith(TMP_PREFIX):
                    removed_other += remove_if_stale_tmp(entry.path)
                    continue
                try:
                    digest = bytes.fromhex(name)
                except ValueError:
                    continue  # not ours; leave it
                if digest in live:
                    continue
                with self._shared.lock:  # put_chunk adds to pending under this lock first
                    if digest in self._shared.pending:
                        continue
                    try:
                        os.unlink(entry.path)
                        removed_chunks += 1
                    except FileNotFoundError:
                        pass
        removed_other += self._collect_packs(live)
        if removed_chunks or removed_other:
            logger.debug(
                "collected %d chunks and %d other files in %s",
                removed_chunks,
                removed_other,
                self.directory,
            )

    def _collect_packs(self, live: set[bytes]) -> int:
        """Delete packs without a live chunk; copy the live chunks of packs that are less than
        half live into a new pack (durable first), then delete those. Returns files removed."""
        removed = 0
        for entry in os.scandir(self._packs):
            if entry.name.startswith(TMP_PREFIX):
                removed += remove_if_stale_tmp(entry.path)
        self._refresh_packs()
        with self._shared.lock:
            packs = dict(self._shared.packs)
            wanted = live | self._shared.pending
        dead, sparse = [], []
        for name, entries in packs.items():
            live_bytes = sum(size for digest, _, size in entries if digest in wanted)
            if not any(digest in wanted for digest, _, _ in entries):
                dead.append(name)
            elif 2 * live_bytes < sum(size for _, _, size in entries):
                sparse.append(name)
        if sparse:
            kept = {d for name, e in packs.items() if name not in sparse for d, _, _ in e}
            moved: dict[bytes, Buffer] = {}
            fds: dict[str, int] = {}
            try:
                for name in sparse:
                    for digest, offset, size in packs[name]:
                        if digest not in wanted or digest in kept or digest in moved:
                            continue
                        if os.path.isfile(self._chunk_path(digest)):
                            continue
                        buffer = memoryview(bytearray(size))
                        if self._read_packed(digest, (name, offset, size), buffer, fds) is None:
                            moved[digest] = buffer
            finally:
                for fd in fds.values():
                    os.close(fd)
            if moved:
                self._write_packs(list(moved.items()), self.durable)
                if self.durable:
                    fsync_dir(self._packs)
            dead += sparse
        with self._shared.lock:
            damaged = {name for name, _ in self._shared.bad}
        for name in dead:
            if name in damaged:  # holds a chunk that failed verification: keep it aside
                self._set_aside(self._packs / name, f"pack-{name}")
                removed += 1
                continue
            try:
                os.unlink(self._packs / name)
                removed += 1
            except FileNotFoundError:
                pass
        if dead:
            self._refresh_packs()
        return removed

    # ------------------------------------------------------------------ reading

    def _read_latest(self) -> list[bytes]:
        return read_latest(self.layout)

    def committed_roots(self) -> list[bytes]:
        """The roots of the committed states, newest first (at most ``keep``)."""
        return self._read_latest()

    def latest(self) -> Manifest:
        """The newest committed manifest."""
        roots = self._read_latest()
        try:
            return self.load_manifest(roots[0])
        except NoCheckpointError:
            raise CheckpointCorruptError(
                f"{self._latest} names state {roots[0].hex()} but its manifest is missing"
            ) from None

    def load_manifest(self, root: bytes) -> Manifest:
        """A committed manifest by its root, verified against it."""
        return read_manifest(self.layout, root)

    def load_tensors(self, manifest: Manifest) -> list[torch.Tensor]:
        """Every tensor of ``manifest``, in order, each chunk verified against its digest.

        Chunks are read straight into one preallocated buffer per tensor. A missing or corrupt
        chunk raises :class:`CheckpointCorruptError` naming the tensor (a corrupt chunk is
        moved aside or forgotten, so that :meth:`missing_chunks` reports it and a download can
        replace it).
        """
        self._refresh_packs()
        buffers = [torch.empty(spec.nbytes, dtype=torch.uint8) for spec in manifest.tensors]
        jobs: list[tuple[int, int, ChunkRef]] = []  # (tensor index, offset, chunk)
        for index, spec in enumerate(manifest.tensors):
            offset = 0
            for ref in spec.chunks:
                jobs.append((index, offset, ref))
                offset += ref.size
        # numpy arrays are buffers (the stubs say so only for Python 3.12's Buffer protocol)
        views = [
            memoryview(b.numpy()).cast("B") if b.numel() else None  # type: ignore[arg-type]
            for b in buffers
        ]

        def read(batch: range) -> None:
            fds: dict[str, int] = {}
            try:
                for j in batch:
                    index, offset, ref = jobs[j]
                    view = views[index]
                    target = (
                        view[offset : offset + ref.size] if view is not None else memoryview(b"")
                    )
                    problem = self._read_verified(ref, target, fds)
                    if problem is not None:
                        spec = manifest.tensors[index]
                        raise CheckpointCorruptError(
                            f"tensor {spec.name!r} of the checkpoint in {self.directory} "
                            f"(epoch {manifest.epoch}) cannot be restored: chunk "
                            f"{ref.digest.hex()} {problem}; load an older checkpoint or "
                            "download the state from peers"
                        )
            finally:
                for fd in fds.values():
                    os.close(fd)

        pool = executor()
        sizes = [ref.size for _, _, ref in jobs]
        for _ in results([pool.submit(read, b) for b in batches(sizes)]):
            pass
        return [
            flat.view(DTYPES[spec.dtype]).reshape(spec.shape)
            for flat, spec in zip(buffers, manifest.tensors, strict=True)
        ]


# ---------------------------------------------------------------------- convenience


def save_state(
    store: StateStore,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    epoch: int,
    metadata: Mapping[str, Any] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Manifest:
    """Checkpoint CPU tensors: the same manifest as :func:`build_manifest`, committed to
    ``store``.

    Hashing and writing run together in the store's thread pool, each full chunk written
    right after it is hashed and only if the store lacks it (small ones go into a pack). The
    tensors must not change until this returns (pass a snapshot).
    """
    named = list(named_tensors)
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}]")
    check_state_layout(named)
    # metadata is validated by build_manifest on no tensors (cheap), keeping one rule set
    empty, _ = build_manifest([], epoch, metadata, chunk_bytes)
    pieces: list[memoryview] = []
    layout: list[tuple[str, str, tuple[int, ...], int]] = []  # name, dtype, shape, n chunks
    for name, tensor in named:
        data = tensor_bytes(tensor)
        sizes = chunk_sizes(len(data), chunk_bytes)
        offset = 0
        for size in sizes:
            pieces.append(data[offset : offset + size])
            offset += size
        layout.append((name, dtype_name(tensor.dtype), tuple(tensor.shape), len(sizes)))

    with store._shared.commit_lock:
        history = store._history_for_write()
        digests = store._store_new(pieces, chunk_bytes)
        specs = []
        position = 0
        for name, dtype, shape, count in layout:
            refs = tuple(
                ChunkRef(digests[i], len(pieces[i])) for i in range(position, position + count)
            )
            position += count
            specs.append(TensorSpec(name, dtype, shape, refs))
        manifest = Manifest(empty.epoch, tuple(specs), chunk_bytes, empty.metadata)
        store._commit_locked(manifest, history, checked=True)
    return manifest


def load_state(store: StateStore) -> tuple[Manifest, list[torch.Tensor]]:
    """The newest committed state of ``store``: its manifest and verified tensors (strict:
    a damaged newest state raises; :func:`load_newest_intact` walks back instead)."""
    manifest = store.latest()
    return manifest, store.load_tensors(manifest)
