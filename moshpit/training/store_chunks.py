"""The content-addressed half of the checkpoint store: chunk files and packs, by digest.

A chunk is stored once (loose under chunks/, or in a pack when a save has many small ones),
found again by its SHA-256 through an in-memory pack index, and verified on every read: a
damaged copy is moved to ``damaged/`` (a loose file) or forgotten (a packed one), so the
network path never serves corrupt bytes and a download can put a good copy back. This is all a
donor's upload and a joiner's download touch; manifests, ``LATEST`` and garbage collection are
``store.py``'s, the file formats ``store_format.py``'s, the durable writes ``store_durable.py``'s.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import secrets
import time
from collections.abc import Sequence

from moshpit.training.errors import CheckpointError
from moshpit.training.manifest import MAX_CHUNK_BYTES, ChunkRef, Manifest
from moshpit.training.store_durable import (
    Buffer,
    Shared,
    batches,
    executor,
    fsync_dir,
    generation,
    results,
    shared_for,
    syncfs,
    syncfs_available,
    write_atomic,
)
from moshpit.training.store_format import (
    DAMAGED_DIR,
    PACK_MIN_CHUNKS,
    TMP_PREFIX,
    CheckpointLayout,
    DamagedPack,
    PackEntry,
    check_digest,
    pack_entries,
    pack_groups,
    pack_header,
    packable,
    read_pack_header,
)

__all__ = ["ChunkStore"]

# the store's one logger name, which users filter on, whichever of its modules logs
logger = logging.getLogger("moshpit.training.store")


class ChunkStore:
    """The chunk and pack files of one checkpoint directory, addressed by digest: what a
    donor serves from and a download fills. :class:`~moshpit.training.store.StateStore` adds
    manifests and commits on top.

    ``durable=False`` skips every fsync (see ``StateStore``).
    """

    def __init__(self, directory: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.directory = pathlib.Path(directory)
        self.durable = durable
        self.layout = CheckpointLayout(self.directory)
        self._chunks = self.layout.chunks
        self._packs = self.layout.packs
        self._manifests = self.layout.manifests
        self._latest = self.layout.latest
        try:
            self._create_dirs()
        except OSError as e:
            raise CheckpointError(
                f"cannot create checkpoint directory {self.directory}: {e}"
            ) from e
        self._key = os.path.realpath(self.directory)
        self._shared_cache = (generation(), shared_for(self._key))

    @property
    def _shared(self) -> Shared:
        born, shared = self._shared_cache
        if born != generation():  # forked since: the parent's locks are not ours
            shared = shared_for(self._key)
            self._shared_cache = (generation(), shared)
        return shared

    def _create_dirs(self) -> None:
        if (self._chunks / "ff").is_dir() and self._manifests.is_dir() and self._packs.is_dir():
            return
        for path in (self.directory, self._chunks, self._manifests, self._packs):
            path.mkdir(parents=True, exist_ok=True)
        for i in range(256):
            (self._chunks / f"{i:02x}").mkdir(exist_ok=True)
        if self.durable:
            for path in (self._chunks, self.directory, self.directory.parent):
                fsync_dir(path)

    # ------------------------------------------------------------------ the pack index

    def _refresh_packs(self) -> None:
        """Bring the in-memory pack index up to date with packs/ (another process may write)."""
        try:
            names = frozenset(n for n in os.listdir(self._packs) if not n.startswith(TMP_PREFIX))
        except FileNotFoundError:
            names = frozenset()
        shared = self._shared
        with shared.lock:
            if names == shared.pack_names:
                return
            known = shared.pack_names
        added = {name: self._read_pack_header(name) for name in names - known}
        with shared.lock:
            for name in list(shared.packs):
                if name not in names:
                    del shared.packs[name]
            shared.packs.update({n: e for n, e in added.items() if e is not None})
            shared.pack_names = names
            shared.rebuild_where()

    def _read_pack_header(self, name: str) -> tuple[PackEntry, ...] | None:
        """A pack's entries, or None (logged) if its header is damaged: its chunks are then
        missing, which loading reports per tensor and a download repairs."""
        path = self._packs / name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                header = read_pack_header(f, size)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("pack %s in %s is unusable: %s", name[:16], self.directory, e)
            return None
        try:
            return pack_entries(header, name, size)
        except DamagedPack as e:
            logger.warning("pack %s in %s %s: ignored", name[:16], self.directory, e)
            return None

    def _packed(self, digest: bytes) -> tuple[str, int, int] | None:
        with self._shared.lock:
            return self._shared.where.get(digest)

    def _present(self, digest: bytes, size: int | None = None) -> bool:
        """Stored loose or packed (the pack index as of the last refresh). With ``size``, a
        chunk file of another size (cut short by a crash) counts as absent, to be rewritten."""
        try:
            st = os.stat(self._chunk_path(digest))
        except FileNotFoundError:
            return self._packed(digest) is not None
        return size is None or st.st_size == size or self._packed(digest) is not None

    def _mark_bad(self, name: str, digest: bytes) -> None:
        with self._shared.lock:
            self._shared.bad.add((name, digest))
            self._shared.rebuild_where()

    # ------------------------------------------------------------------ chunks

    def _chunk_path(self, digest: bytes) -> str:
        return self.layout.chunk_path(digest)

    def has_chunk(self, digest: bytes) -> bool:
        check_digest(digest)
        if os.path.isfile(self._chunk_path(digest)):
            return True
        self._refresh_packs()
        return self._packed(digest) is not None

    def read_chunk(self, digest: bytes) -> bytes | None:
        """A chunk's bytes, or None if absent. A chunk whose bytes do not match its digest is
        moved aside, or forgotten if it is in a pack (and None returned): the network path must
        never serve corrupt bytes."""
        check_digest(digest)
        path = self._chunk_path(digest)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                data = f.read(MAX_CHUNK_BYTES + 1) if size <= MAX_CHUNK_BYTES else None
                inode = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            data = inode = None
        except OSError as e:
            raise CheckpointError(
                f"cannot read chunk {digest.hex()} in {self.directory}: {e}"
            ) from e
        if inode is not None:
            if data is not None and hashlib.sha256(data).digest() == digest:
                return data
            logger.warning(
                "chunk %s in %s does not match its digest (damaged disk?): moved to %s",
                digest.hex()[:16],
                self.directory,
                DAMAGED_DIR,
            )
            self._discard_corrupt(path, inode)
        self._refresh_packs()
        location = self._packed(digest)
        if location is None:
            return None
        buffer = bytearray(location[2])
        problem = self._read_packed(digest, location, memoryview(buffer), {})
        return bytes(buffer) if problem is None else None

    def _read_packed(
        self,
        digest: bytes,
        location: tuple[str, int, int],
        target: memoryview,
        fds: dict[str, int],
    ) -> str | None:
        """Read a packed chunk into ``target`` (its exact size) and verify it; returns what is
        wrong, or None. A bad copy is forgotten (logged). ``fds`` caches open packs."""
        name, offset, size = location
        try:
            fd = fds.get(name)
            if fd is None:
                fd = fds[name] = os.open(self._packs / name, os.O_RDONLY | os.O_CLOEXEC)
            got = 0
            while got < size:
                n = os.preadv(fd, [target[got:]], offset + got)
                if n == 0:
                    break
                got += n
        except FileNotFoundError:
            return "is missing (its pack was removed)"
        except OSError as e:
            return f"cannot be read ({e})"
        if got != size:
            problem = "is cut short in its pack"
        elif hashlib.sha256(target).digest() != digest:
            problem = "does not match its digest (damaged)"
        else:
            return None
        logger.warning(
            "chunk %s in pack %s of %s %s: not used",
            digest.hex()[:16],
            name[:16],
            self.directory,
            problem,
        )
        self._mark_bad(name, digest)
        return problem

    def _discard_corrupt(self, path: str, inode: int) -> None:
        """Move a corrupt chunk file aside unless a good copy was renamed over it meanwhile."""
        try:
            if os.stat(path).st_ino == inode:
                self._set_aside(path, f"chunk-{os.path.basename(path)}")
        except FileNotFoundError:
            pass

    @property
    def damaged_dir(self) -> pathlib.Path:
        """Where damaged files go (kept for inspection; delete them by hand when done)."""
        return self.layout.damaged

    def _set_aside(self, path: str | os.PathLike[str], label: str) -> None:
        """Move a damaged file out of the checkpoint's way into :attr:`damaged_dir` (a rename:
        nothing is copied, and a damaged file is never deleted without a trace)."""
        target = (
            self.damaged_dir / f"{label}.{time.strftime('%Y%m%dT%H%M%S')}.{secrets.token_hex(3)}"
        )
        try:
            self.damaged_dir.mkdir(exist_ok=True)
            os.replace(path, target)
        except FileNotFoundError:
            return
        except OSError as e:  # a read-only or full disk: leave it where it is
            logger.warning("could not move damaged %s aside: %s", path, e)
            return
        logger.debug("moved damaged %s to %s", path, target)

    def put_chunk(self, digest: bytes, data: bytes | bytearray | memoryview) -> None:
        """Store one chunk (a downloader's path): verified, atomic, no-op if already present.

        The chunk is protected from garbage collection until a manifest referencing it is
        committed (or this process ends).
        """
        check_digest(digest)
        if hashlib.sha256(data).digest() != digest:
            raise ValueError(f"chunk bytes do not hash to {digest.hex()}")
        with self._shared.lock:  # before the existence check: see _collect_garbage
            self._shared.pending.add(digest)
        if self.has_chunk(digest):
            return
        self._write_loose(digest, data, self.durable)

    def _write_loose(self, digest: bytes, data: Buffer, sync: bool) -> None:
        path = self._chunk_path(digest)
        try:
            write_atomic(path, [data], sync)
        except OSError as e:
            raise CheckpointError(
                f"cannot write chunk {digest.hex()} into {self.directory}: {e}"
            ) from e
        if self.durable:
            with self._shared.lock:
                self._shared.dirty_dirs.add(os.path.dirname(path))

    def _write_packs(self, items: Sequence[tuple[bytes, Buffer]], sync: bool) -> None:
        """Write small chunks as pack files (store_format.pack_groups) and index them."""
        for indices in pack_groups([len(data) for _, data in items]):
            group = items[indices.start : indices.stop]
            header, name, entries = pack_header([(digest, len(data)) for digest, data in group])
            try:
                write_atomic(self._packs / name, [header, *(d for _, d in group)], sync)
            except OSError as e:
                raise CheckpointError(f"cannot write a pack into {self.directory}: {e}") from e
            with self._shared.lock:
                self._shared.packs[name] = entries
                self._shared.pack_names = self._shared.pack_names | {name}
                for digest, off, size in entries:
                    self._shared.where.setdefault(digest, (name, off, size))
                if self.durable:
                    self._shared.dirty_dirs.add(str(self._packs))

    def missing_chunks(self, manifest: Manifest) -> dict[bytes, int]:
        """The chunks of ``manifest`` this store lacks, with their sizes."""
        self._refresh_packs()
        return {d: s for d, s in manifest.chunk_refs().items() if not self._present(d)}

    # ------------------------------------------------------------------ saving and reading

    def _store_new(
        self,
        pieces: Sequence[Buffer],
        full_chunk: int,
        expected: Sequence[tuple[bytes, int]] | None = None,
    ) -> list[bytes]:
        """Hash ``pieces`` (in the pool) and store those this store lacks; returns digests.

        With ``expected`` ((digest, size) per piece), a piece that does not match raises
        ValueError. Full-size chunks are written loose by the workers right after hashing;
        short ones are packed if there are many. On Linux every file is made durable by one
        syncfs at the end, elsewhere by an fsync per file plus the directories at commit.
        """
        self._refresh_packs()
        batch_sync = self.durable and syncfs_available()
        sync_each = self.durable and not batch_sync

        def work(batch: range) -> list[bytes]:
            out = []
            for i in batch:
                piece = pieces[i]
                digest = hashlib.sha256(piece).digest()
                if expected is not None and (digest, len(piece)) != expected[i]:
                    raise ValueError(
                        f"chunk {expected[i][0].hex()} given to save() does not match its "
                        "digest or size: was a tensor modified while it was being saved?"
                    )
                if not packable(len(piece), full_chunk) and not self._present(digest, len(piece)):
                    self._write_loose(digest, piece, sync_each)
                out.append(digest)
            return out

        digests: list[bytes] = []
        pool = executor()
        sizes = [len(p) for p in pieces]
        for part in results([pool.submit(work, b) for b in batches(sizes)]):
            digests.extend(part)
        small: dict[bytes, Buffer] = {}
        for digest, piece in zip(digests, pieces, strict=True):
            if (
                packable(len(piece), full_chunk)
                and digest not in small
                and not self._present(digest, len(piece))
            ):
                small[digest] = piece
        if len(small) >= PACK_MIN_CHUNKS:
            self._write_packs(list(small.items()), sync_each)
        else:
            for digest, piece in small.items():
                self._write_loose(digest, piece, sync_each)
        if batch_sync:
            with self._shared.lock:  # syncfs covers every rename done before it
                written = bool(self._shared.dirty_dirs)
                self._shared.dirty_dirs.clear()
            if not written:  # nothing new (an unchanged state): no flush to wait for
                return digests
            try:
                syncfs(self.directory)
            except OSError as e:
                raise CheckpointError(f"cannot flush {self.directory} to disk: {e}") from e
            self._shared.flushed_once = True  # the whole file system, older files included
        return digests

    def _read_verified(self, ref: ChunkRef, target: memoryview, fds: dict[str, int]) -> str | None:
        """Read one chunk into ``target`` from its file or its pack; returns what is wrong
        with it, or None. A corrupt chunk file is moved aside (a packed copy may still serve)."""
        path = self._chunk_path(ref.digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
        except OSError as e:
            return f"cannot be read ({e})"
        problem = "is missing"
        if fd is not None:
            try:
                st = os.fstat(fd)
                if st.st_size != ref.size:
                    problem = f"is {st.st_size} bytes, expected {ref.size}"
                else:
                    got = 0
                    while got < ref.size:
                        n = os.readv(fd, [target[got:]])
                        if n == 0:
                            break
                        got += n
                    if got != ref.size:
                        problem = f"is shorter than {ref.size} bytes"
                    elif hashlib.sha256(target).digest() != ref.digest:
                        problem = "does not match its digest (damaged)"
                    else:
                        return None
            except OSError as e:
                return f"cannot be read ({e})"
            finally:
                os.close(fd)
            logger.warning(
                "chunk %s in %s: %s; moved to %s",
                ref.digest.hex()[:16],
                self.directory,
                problem,
                DAMAGED_DIR,
            )
            self._discard_corrupt(path, st.st_ino)
            problem += f" (moved to {DAMAGED_DIR}/)"
        location = self._packed(ref.digest)
        if location is None:
            return problem
        if location[2] != ref.size:
            return f"is {location[2]} bytes in its pack, expected {ref.size}"
        packed_problem = self._read_packed(ref.digest, location, target, fds)
        return None if packed_problem is None else packed_problem
