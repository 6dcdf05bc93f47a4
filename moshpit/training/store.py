"""Checkpoints: a directory of content-addressed chunks plus manifests, committed atomically.

Layout (format version 1, documented in docs/training-state.md, "Checkpoint format")::

    <dir>/LATEST                    which manifests are committed, newest first (text, checksummed)
    <dir>/manifests/<root hex>      a manifest's canonical msgpack bytes (SHA-256 = root)
    <dir>/chunks/<2 hex>/<64 hex>   a chunk's raw bytes, named by their SHA-256

Why this shape: a chunk is written once however many checkpoints share it, so saving a state
whose tensors barely changed writes little, and the same directory is what a donor serves
chunks from (by digest). A commit is a chain of write-new, fsync, rename steps: chunks, then
the manifest, then ``LATEST``; a crash (or ``kill -9``) at any point leaves ``LATEST`` naming
either the previous or the new manifest, and everything that manifest names is already on
disk. Old chunks are garbage-collected only after the new ``LATEST`` is durable.

Everything read back is verified against its hash, so a damaged disk gives
:class:`CheckpointCorruptError` naming the tensor, never a silently wrong model.

One writer process per directory (several threads and several :class:`StateStore` objects of
one process may share it). Readers in other processes are fine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import secrets
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from moshpit.training.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    ManifestError,
    NoCheckpointError,
)
from moshpit.training.manifest import (
    DEFAULT_CHUNK_BYTES,
    DIGEST_BYTES,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    ChunkRef,
    Manifest,
    TensorSpec,
    build_manifest,
    dtype_name,
    tensor_bytes,
)

__all__ = ["STORE_FORMAT_VERSION", "StateStore", "load_state", "save_state"]

logger = logging.getLogger(__name__)

STORE_FORMAT_VERSION = 1
LATEST_MAGIC = "moshpit-checkpoint"
MAX_LATEST_BYTES = 64 << 10
TMP_PREFIX = ".tmp-"
# Work is cut into batches of about this many bytes (and at most this many files), so that many
# small tensors do not cost one thread hand-off each while big states still spread over threads.
BATCH_BYTES = 4 << 20
BATCH_FILES = 64

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_POOL_THREADS = min(8, max(4, os.cpu_count() or 1))  # fsync waits, so more threads than cores


def _executor() -> ThreadPoolExecutor:
    """One process-wide pool: hashlib, file reads/writes and fsync all release the GIL."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="moshpit-store")
        return _pool


@dataclass
class _Shared:
    """What every StateStore of one directory in this process shares."""

    commit_lock: threading.RLock = field(default_factory=threading.RLock)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: set[bytes] = field(default_factory=set)  # put_chunk()ed, not yet committed
    dirty_dirs: set[str] = field(default_factory=set)  # renamed into, dir not yet fsynced


_shared_lock = threading.Lock()
_shared: dict[str, _Shared] = {}
_in_flight: set[str] = set()  # names of this process's tmp files being written (random, unique)
_in_flight_lock = threading.Lock()


def _shared_for(directory: pathlib.Path) -> _Shared:
    key = os.path.realpath(directory)
    with _shared_lock:
        return _shared.setdefault(key, _Shared())


def _check_digest(digest: bytes) -> None:
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        raise ValueError(f"a chunk digest is {DIGEST_BYTES} bytes, got {digest!r:.80}")


def _fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _write_atomic(final: pathlib.Path, data: bytes | bytearray | memoryview, sync: bool) -> None:
    """Write ``data`` to a tmp file next to ``final``, fsync it, rename it over ``final``.

    The caller fsyncs the directory (once for many files) before relying on the rename.
    """
    name = f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    tmp = str(final.parent / name)
    with _in_flight_lock:
        _in_flight.add(name)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    finally:
        with _in_flight_lock:
            _in_flight.discard(name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_tmp(path: str) -> bool:
    """A tmp file is stale when its writer is gone: another, dead process, or an earlier
    process that had our pid (containers restart as pid 1) and is not in our in-flight set."""
    name = os.path.basename(path)
    try:
        pid = int(name[len(TMP_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return True
    if pid == os.getpid():
        with _in_flight_lock:
            return name not in _in_flight
    return not _pid_alive(pid)


def _batches(sizes: Sequence[int]) -> list[range]:
    """Split items with these byte sizes into contiguous index ranges for the pool."""
    out: list[range] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= BATCH_BYTES or i + 1 - start >= BATCH_FILES:
            out.append(range(start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def _results(futures: Iterable[Future]) -> Iterator[Any]:
    """Results in order; on an error, wait for the rest before raising (no stray writers)."""
    futures = list(futures)
    error: BaseException | None = None
    for future in futures:
        try:
            result = future.result()
        except BaseException as e:
            if error is None:
                error = e
            continue
        if error is None:
            yield result
    if error is not None:
        raise error


class StateStore:
    """A checkpoint directory: chunks/<2 hex>/<64 hex> files named by SHA-256, manifests/<root
    hex>, and a LATEST pointer file naming the committed root. Doubles as a donor's serving
    store.

    ``keep`` committed states are kept; chunks referenced by none of them are deleted on the
    next commit, except chunks :meth:`put_chunk` stored since (a download in progress).
    ``durable=False`` skips every fsync: still safe against a killed process (the page cache
    survives it), not against a power cut; meant for tests and scratch runs.
    """

    def __init__(
        self, directory: str | os.PathLike, *, keep: int = 2, durable: bool = True
    ) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1 (the committed state itself)")
        self.directory = pathlib.Path(directory)
        self.keep = keep
        self.durable = durable
        self._chunks = self.directory / "chunks"
        self._manifests = self.directory / "manifests"
        self._latest = self.directory / "LATEST"
        try:
            self._create_dirs()
        except OSError as e:
            raise CheckpointError(
                f"cannot create checkpoint directory {self.directory}: {e}"
            ) from e
        self._shared = _shared_for(self.directory)

    def _create_dirs(self) -> None:
        if (self._chunks / "ff").is_dir() and self._manifests.is_dir():
            return
        for path in (self.directory, self._chunks, self._manifests):
            path.mkdir(parents=True, exist_ok=True)
        for i in range(256):
            (self._chunks / f"{i:02x}").mkdir(exist_ok=True)
        if self.durable:
            for path in (self._chunks, self.directory, self.directory.parent):
                _fsync_dir(path)

    def __repr__(self) -> str:
        return f"StateStore({str(self.directory)!r}, keep={self.keep})"

    # ------------------------------------------------------------------ chunks

    def _chunk_path(self, digest: bytes) -> pathlib.Path:
        hexd = digest.hex()
        return self._chunks / hexd[:2] / hexd

    def has_chunk(self, digest: bytes) -> bool:
        _check_digest(digest)
        return self._chunk_path(digest).is_file()

    def read_chunk(self, digest: bytes) -> bytes | None:
        """A chunk's bytes, or None if absent. A chunk whose bytes do not match its digest is
        deleted (and None returned): the network path must never serve corrupt bytes."""
        _check_digest(digest)
        path = self._chunk_path(digest)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                data = f.read(MAX_CHUNK_BYTES + 1) if size <= MAX_CHUNK_BYTES else None
                inode = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointError(
                f"cannot read chunk {digest.hex()} in {self.directory}: {e}"
            ) from e
        if data is not None and hashlib.sha256(data).digest() == digest:
            return data
        logger.warning(
            "chunk %s in %s does not match its digest (damaged disk?): deleted",
            digest.hex()[:16],
            self.directory,
        )
        self._discard_corrupt(path, inode)
        return None

    def _discard_corrupt(self, path: pathlib.Path, inode: int) -> None:
        """Delete a corrupt chunk file unless a good copy was renamed over it meanwhile."""
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except FileNotFoundError:
            pass

    def put_chunk(self, digest: bytes, data: bytes | bytearray | memoryview) -> None:
        """Store one chunk (a downloader's path): verified, atomic, no-op if already present.

        The chunk is protected from garbage collection until a manifest referencing it is
        committed (or this process ends).
        """
        _check_digest(digest)
        if hashlib.sha256(data).digest() != digest:
            raise ValueError(f"chunk bytes do not hash to {digest.hex()}")
        with self._shared.lock:  # before the existence check: see _collect_garbage
            self._shared.pending.add(digest)
        path = self._chunk_path(digest)
        if path.is_file():
            return
        self._write_chunk(path, data)

    def _write_chunk(self, path: pathlib.Path, data: bytes | bytearray | memoryview) -> None:
        try:
            _write_atomic(path, data, self.durable)
        except OSError as e:
            raise CheckpointError(
                f"cannot write chunk {path.name} into {self.directory}: {e}"
            ) from e
        if self.durable:
            with self._shared.lock:
                self._shared.dirty_dirs.add(str(path.parent))

    def missing_chunks(self, manifest: Manifest) -> dict[bytes, int]:
        """The chunks of ``manifest`` this store lacks, with their sizes."""
        return {d: s for d, s in manifest.chunk_refs().items() if not self.has_chunk(d)}

    # ------------------------------------------------------------------ commits

    def save(self, manifest: Manifest, chunks: Mapping[bytes, bytes | memoryview]) -> None:
        """Write the chunks this store lacks (each verified), then commit ``manifest``."""
        with self._shared.commit_lock:
            history = self._history_for_write()
            refs = manifest.chunk_refs()
            todo = [d for d in refs if not self.has_chunk(d)]
            for digest in todo:
                if digest not in chunks:
                    raise CheckpointError(
                        f"chunk {digest.hex()} of the manifest is neither in the store nor in "
                        "the chunks given to save()"
                    )
            sizes = [refs[d] for d in todo]

            def write(batch: range) -> None:
                for i in batch:
                    digest, data = todo[i], chunks[todo[i]]
                    if len(data) != sizes[i] or hashlib.sha256(data).digest() != digest:
                        raise ValueError(
                            f"chunk {digest.hex()} given to save() does not match its digest "
                            "or size: was a tensor modified while it was being saved?"
                        )
                    self._write_chunk(self._chunk_path(digest), data)

            pool = _executor()
            for _ in _results([pool.submit(write, b) for b in _batches(sizes)]):
                pass
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

    def _commit_locked(self, manifest: Manifest, history: list[bytes]) -> None:
        """Chunks durable -> manifest durable -> LATEST replaced -> garbage collection.

        ``history`` is :meth:`_history_for_write`, read before any chunk was written.
        """
        root = manifest.root
        try:
            if self.durable:
                with self._shared.lock:
                    dirty, self._shared.dirty_dirs = self._shared.dirty_dirs, set()
                for _ in _results([_executor().submit(_fsync_dir, d) for d in sorted(dirty)]):
                    pass
            _write_atomic(self._manifests / root.hex(), manifest.to_bytes(), self.durable)
            if self.durable:
                _fsync_dir(self._manifests)
            history = [root] + [r for r in history if r != root]
            history = history[: self.keep]
            _write_atomic(self._latest, _format_latest(history), self.durable)
            if self.durable:
                _fsync_dir(self.directory)
        except OSError as e:
            raise CheckpointError(f"cannot commit a checkpoint into {self.directory}: {e}") from e
        refs = manifest.chunk_refs()
        with self._shared.lock:
            self._shared.pending.difference_update(refs)
        logger.debug("committed state %s (epoch %d)", root.hex()[:16], manifest.epoch)
        try:
            self._collect_garbage(history, {root: manifest})
        except OSError as e:  # the commit stands; leftovers go next time
            logger.warning("garbage collection in %s failed: %s", self.directory, e)

    def _history_for_write(self) -> list[bytes]:
        """The committed roots, or [] when LATEST is absent or unreadable (then we start over).

        A LATEST of a newer store format is never overwritten: that moshpit's checkpoints
        would become unreadable to it.
        """
        try:
            return self._read_latest()
        except NoCheckpointError:
            return []
        except CheckpointCorruptError as e:
            logger.warning("%s; the next commit replaces it", e)
            return []

    def _collect_garbage(self, history: list[bytes], known: dict[bytes, Manifest]) -> None:
        """Delete manifests not in ``history``, chunks none of them reference (unless pending),
        and tmp files whose writer is gone."""
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
                removed_other += self._remove_if_stale_tmp(entry.path)
            elif entry.name not in keep_names:
                os.unlink(entry.path)
                removed_other += 1
        for entry in os.scandir(self.directory):
            if entry.name.startswith(TMP_PREFIX):
                removed_other += self._remove_if_stale_tmp(entry.path)
        for sub in os.scandir(self._chunks):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name = entry.name
                if name.startswith(TMP_PREFIX):
                    removed_other += self._remove_if_stale_tmp(entry.path)
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
        if removed_chunks or removed_other:
            logger.debug(
                "collected %d chunks and %d other files in %s",
                removed_chunks,
                removed_other,
                self.directory,
            )

    @staticmethod
    def _remove_if_stale_tmp(path: str) -> int:
        if not _stale_tmp(path):
            return 0
        try:
            os.unlink(path)
        except FileNotFoundError:
            return 0
        return 1

    # ------------------------------------------------------------------ reading

    def _read_latest(self) -> list[bytes]:
        try:
            with open(self._latest, "rb") as f:
                data = f.read(MAX_LATEST_BYTES + 1)
        except FileNotFoundError:
            raise NoCheckpointError(f"no checkpoint in {self.directory} yet") from None
        except OSError as e:
            raise CheckpointError(f"cannot read {self._latest}: {e}") from None
        return _parse_latest(data, self._latest)

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
        if not isinstance(root, bytes) or len(root) != DIGEST_BYTES:
            raise ValueError(f"a state root is {DIGEST_BYTES} bytes")
        path = self._manifests / root.hex()
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            raise NoCheckpointError(f"no manifest {root.hex()} in {self.directory}") from None
        except OSError as e:
            raise CheckpointError(f"cannot read manifest {path}: {e}") from None
        if hashlib.sha256(data).digest() != root:
            raise CheckpointCorruptError(
                f"manifest {path} is truncated or damaged (its bytes do not hash to its name); "
                "restore this checkpoint from a backup or download the state from peers"
            )
        _check_manifest_version(data, path)
        try:
            return Manifest.from_bytes(data)
        except ManifestError as e:
            raise CheckpointCorruptError(f"manifest {path} is not a valid manifest: {e}") from None

    def load_tensors(self, manifest: Manifest) -> list[torch.Tensor]:
        """Every tensor of ``manifest``, in order, each chunk verified against its digest.

        Chunks are read straight into one preallocated buffer per tensor. A missing or corrupt
        chunk raises :class:`CheckpointCorruptError` naming the tensor (a corrupt chunk file is
        deleted, so that :meth:`missing_chunks` reports it and a download can replace it).
        """
        buffers = [torch.empty(spec.nbytes, dtype=torch.uint8) for spec in manifest.tensors]
        jobs: list[tuple[int, int, ChunkRef]] = []  # (tensor index, offset, chunk)
        for index, spec in enumerate(manifest.tensors):
            offset = 0
            for ref in spec.chunks:
                jobs.append((index, offset, ref))
                offset += ref.size
        views = [memoryview(b.numpy()).cast("B") if b.numel() else None for b in buffers]

        def read(batch: range) -> None:
            for j in batch:
                index, offset, ref = jobs[j]
                view = views[index]
                target = view[offset : offset + ref.size] if view is not None else None
                problem = self._read_verified(ref, target)
                if problem is not None:
                    spec = manifest.tensors[index]
                    raise CheckpointCorruptError(
                        f"tensor {spec.name!r} of the checkpoint in {self.directory} (epoch "
                        f"{manifest.epoch}) cannot be restored: chunk {ref.digest.hex()} "
                        f"{problem}; load an older checkpoint or download the state from peers"
                    )

        pool = _executor()
        sizes = [ref.size for _, _, ref in jobs]
        for _ in _results([pool.submit(read, b) for b in _batches(sizes)]):
            pass
        return [
            flat.view(DTYPES[spec.dtype]).reshape(spec.shape)
            for flat, spec in zip(buffers, manifest.tensors, strict=True)
        ]

    def _read_verified(self, ref: ChunkRef, target: memoryview | None) -> str | None:
        """Read one chunk into ``target``; returns what is wrong with it, or None."""
        path = self._chunk_path(ref.digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return "is missing"
        except OSError as e:
            return f"cannot be read ({e})"
        try:
            st = os.fstat(fd)
            if st.st_size != ref.size:
                problem = f"is {st.st_size} bytes, expected {ref.size}"
            else:
                got = 0
                while target is not None and got < ref.size:
                    n = os.readv(fd, [target[got:]])
                    if n == 0:
                        break
                    got += n
                data = target if target is not None else b""
                if got != ref.size:
                    problem = f"is shorter than {ref.size} bytes"
                elif hashlib.sha256(data).digest() != ref.digest:
                    problem = "does not match its digest (damaged)"
                else:
                    return None
        except OSError as e:
            return f"cannot be read ({e})"
        finally:
            os.close(fd)
        logger.warning(
            "chunk %s in %s: %s; deleted", ref.digest.hex()[:16], self.directory, problem
        )
        self._discard_corrupt(path, st.st_ino)
        return problem + " (deleted)"


# ---------------------------------------------------------------------- LATEST and versions


def _format_latest(history: Sequence[bytes]) -> bytes:
    body = f"{LATEST_MAGIC} {STORE_FORMAT_VERSION}\n" + "".join(f"{r.hex()}\n" for r in history)
    check = hashlib.sha256(body.encode()).hexdigest()
    return (body + f"sha256 {check}\n").encode()


def _parse_latest(data: bytes, path: pathlib.Path) -> list[bytes]:
    """Parse LATEST strictly: a newer format is CheckpointFormatError, anything else that is
    not exactly what _format_latest writes is CheckpointCorruptError."""
    corrupt = CheckpointCorruptError(
        f"{path} is damaged (not a moshpit checkpoint pointer); the manifests/ directory still "
        "holds the committed states, or download the state from peers"
    )
    if len(data) > MAX_LATEST_BYTES:
        raise corrupt
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise corrupt from None
    lines = text.split("\n")
    header = lines[0].split(" ")
    if len(header) != 2 or header[0] != LATEST_MAGIC or not header[1].isdigit():
        raise corrupt
    if int(header[1]) != STORE_FORMAT_VERSION:
        raise CheckpointFormatError(
            f"checkpoint directory {path.parent} uses store format version {header[1]}; this "
            f"moshpit reads version {STORE_FORMAT_VERSION}: upgrade moshpit to load it"
        )
    # lines: header, roots..., "sha256 <hex>", "" (after the final newline)
    if len(lines) < 4 or lines[-1] != "" or not lines[-2].startswith("sha256 "):
        raise corrupt
    body = "\n".join(lines[:-2]) + "\n"
    if hashlib.sha256(body.encode()).hexdigest() != lines[-2][len("sha256 ") :]:
        raise corrupt
    roots = []
    for line in lines[1:-2]:
        if len(line) != 2 * DIGEST_BYTES:
            raise corrupt
        try:
            roots.append(bytes.fromhex(line))
        except ValueError:
            raise corrupt from None
    return roots


def _check_manifest_version(data: bytes, path: pathlib.Path) -> None:
    """An authentic manifest of another format version is a format error, not corruption."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types; from_bytes reports it
        return
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        return
    version = obj.get("version")
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(
            f"checkpoint manifest {path} has state format version {version!r}; this moshpit "
            f"reads version {FORMAT_VERSION}: upgrade moshpit to load it"
        )


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

    Hashing and writing run together in the store's thread pool, each chunk written right
    after it is hashed and only if the store lacks it. The tensors must not change until this
    returns (pass a snapshot).
    """
    named = list(named_tensors)
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}]")
    # metadata is validated by build_manifest on no tensors (cheap), keeping one rule set
    empty, _ = build_manifest([], epoch, metadata, chunk_bytes)
    pieces: list[memoryview] = []
    layout: list[tuple[str, str, tuple[int, ...], int]] = []  # name, dtype, shape, n chunks
    for name, tensor in named:
        data = tensor_bytes(tensor)
        sizes = _chunk_sizes(len(data), chunk_bytes)
        offset = 0
        for size in sizes:
            pieces.append(data[offset : offset + size])
            offset += size
        layout.append((name, dtype_name(tensor.dtype), tuple(tensor.shape), len(sizes)))

    with store._shared.commit_lock:
        history = store._history_for_write()

        def hash_and_write(batch: range) -> list[bytes]:
            digests = []
            for i in batch:
                digest = hashlib.sha256(pieces[i]).digest()
                path = store._chunk_path(digest)
                if not path.is_file():
                    store._write_chunk(path, pieces[i])
                digests.append(digest)
            return digests

        pool = _executor()
        digests: list[bytes] = []
        futures = [pool.submit(hash_and_write, b) for b in _batches([len(p) for p in pieces])]
        for part in _results(futures):
            digests.extend(part)
        specs = []
        position = 0
        for name, dtype, shape, count in layout:
            refs = tuple(
                ChunkRef(digests[i], len(pieces[i])) for i in range(position, position + count)
            )
            position += count
            specs.append(TensorSpec(name, dtype, shape, refs))
        manifest = Manifest(empty.epoch, tuple(specs), chunk_bytes, empty.metadata)
        store._commit_locked(manifest, history)
    return manifest


def _chunk_sizes(nbytes: int, chunk_bytes: int) -> list[int]:
    """The same cut as build_manifest: full chunks, the remainder, one empty chunk for 0 bytes."""
    if nbytes == 0:
        return [0]
    full, rest = divmod(nbytes, chunk_bytes)
    return [chunk_bytes] * full + ([rest] if rest else [])


def load_state(store: StateStore) -> tuple[Manifest, list[torch.Tensor]]:
    """The newest committed state of ``store``: its manifest and verified tensors."""
    manifest = store.latest()
    return manifest, store.load_tensors(manifest)
