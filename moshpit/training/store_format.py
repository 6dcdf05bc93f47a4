"""The checkpoint directory's on-disk format: where each file goes and how its bytes look.

Layout (store format version 1, documented in docs/training-state.md, "Checkpoint format")::

    <dir>/LATEST                    which manifests are committed, newest first (text, checksummed)
    <dir>/manifests/<root hex>      a manifest's canonical msgpack bytes (SHA-256 = root)
    <dir>/chunks/<2 hex>/<64 hex>   a chunk's raw bytes, named by their SHA-256
    <dir>/packs/<64 hex>            many small chunks in one file (header: digest, offset, size)
    <dir>/damaged/                  damaged files set aside (never read back)
    .tmp-<pid>-<random>             a file being written, in the directory it will be renamed in

Why this shape: a chunk is written once however many checkpoints share it, so saving a state
whose tensors barely changed writes little, and the same directory is what a donor serves
chunks from (by digest). Every name is the hash of the bytes it holds (a pack's, of its
header), so anything read back can be verified against its own name.

Small chunks (small tensors, the tails of big ones) go into pack files when a save has many of
them: a file per 16 KiB tensor would cost a create, a rename and a directory entry each, and a
model with thousands of small tensors would checkpoint far slower than ``torch.save``.

This module knows the format only; writing it durably is ``store_durable.py``'s job, verifying
what is read and setting damaged files aside ``store_chunks.py``'s, committing and collecting
garbage ``store.py``'s, falling back to an older state ``store_restore.py``'s.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, BinaryIO

import msgpack

from moshpit.training.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    ManifestError,
    NoCheckpointError,
)
from moshpit.training.manifest import (
    DIGEST_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    MAX_DIMS,
    MAX_MANIFEST_BYTES,
    MAX_NAME_CHARS,
    MAX_TENSORS,
    Manifest,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "DAMAGED_DIR",
    "LATEST_MAGIC",
    "MAX_LATEST_BYTES",
    "PACK_CHUNK_MAX",
    "PACK_COUNT",
    "PACK_ENTRY",
    "PACK_MAGIC",
    "PACK_MAX_BYTES",
    "PACK_MIN_CHUNKS",
    "STORE_FORMAT_VERSION",
    "TMP_PREFIX",
    "CheckpointLayout",
    "DamagedPack",
    "PackEntry",
    "check_digest",
    "check_state_layout",
    "chunk_sizes",
    "format_latest",
    "manifest_file_intact",
    "pack_entries",
    "pack_groups",
    "pack_header",
    "packable",
    "parse_latest",
    "read_latest",
    "read_manifest",
    "read_pack_header",
    "tmp_writer_pid",
]

STORE_FORMAT_VERSION = 1
LATEST_MAGIC = "moshpit-checkpoint"
DAMAGED_DIR = "damaged"  # damaged files are moved here for inspection, never deleted
MAX_LATEST_BYTES = 64 << 10
TMP_PREFIX = ".tmp-"
PACK_MAGIC = b"moshpit-pack v1\n"
PACK_COUNT = struct.Struct("<I")
PACK_ENTRY = struct.Struct("<32sQQ")  # digest, offset in the file, size
PACK_CHUNK_MAX = 256 << 10  # a chunk shorter than a full chunk and at most this is packed...
PACK_MIN_CHUNKS = 8  # ...when a save has at least this many new ones (else written loose)
PACK_MAX_BYTES = 64 << 20

PackEntry = tuple[bytes, int, int]  # digest, offset in the pack file, size


class CheckpointLayout:
    """The paths of one checkpoint directory."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = pathlib.Path(directory)
        self.chunks = self.directory / "chunks"
        self.packs = self.directory / "packs"
        self.manifests = self.directory / "manifests"
        self.latest = self.directory / "LATEST"
        self.damaged = self.directory / DAMAGED_DIR
        self._chunks_str = str(self.chunks)

    def chunk_dirs(self) -> list[str]:
        """The 256 directories loose chunks go into, by the first byte of their digest."""
        return [f"{self._chunks_str}/{i:02x}" for i in range(256)]

    def chunk_path(self, digest: bytes) -> str:
        hexd = digest.hex()  # a str, not a Path: this runs for every chunk of every save
        return f"{self._chunks_str}/{hexd[:2]}/{hexd}"

    def manifest_path(self, root: bytes) -> pathlib.Path:
        return self.manifests / root.hex()


def check_digest(digest: bytes) -> None:
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        raise ValueError(f"a chunk digest is {DIGEST_BYTES} bytes, got {digest!r:.80}")


def tmp_writer_pid(name: str) -> int | None:
    """The process id in a tmp file's name (None if the name holds none)."""
    try:
        return int(name[len(TMP_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return None


# ---------------------------------------------------------------------- what a save writes


def chunk_sizes(nbytes: int, chunk_bytes: int) -> list[int]:
    """The same cut as build_manifest: full chunks, the remainder, one empty chunk for 0 bytes."""
    if nbytes == 0:
        return [0]
    full, rest = divmod(nbytes, chunk_bytes)
    return [chunk_bytes] * full + ([rest] if rest else [])


def check_state_layout(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """What Manifest.from_bytes would refuse in a state built from real tensors, checked
    before anything is written (cheaper than parsing the manifest back)."""
    if len(named) > MAX_TENSORS:
        raise CheckpointError(
            f"this state cannot be checkpointed: {len(named)} tensors, the limit is {MAX_TENSORS}"
        )
    seen: set[str] = set()
    for name, tensor in named:
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise CheckpointError(
                f"this state cannot be checkpointed: tensor name {name!r:.80} must be a string "
                f"of 1..{MAX_NAME_CHARS} characters"
            )
        if name in seen:
            raise CheckpointError(
                f"this state cannot be checkpointed: tensor name {name!r} appears twice"
            )
        seen.add(name)
        if tensor.dim() > MAX_DIMS:
            raise CheckpointError(
                f"this state cannot be checkpointed: tensor {name!r} has {tensor.dim()} "
                f"dimensions, the limit is {MAX_DIMS}"
            )


# ---------------------------------------------------------------------- packs


def packable(size: int, full_chunk: int) -> bool:
    """Does a chunk of ``size`` bytes go into a pack (when a save has enough of them)?"""
    return size < full_chunk and size <= PACK_CHUNK_MAX


def pack_groups(sizes: Sequence[int]) -> list[range]:
    """Cut chunks of these sizes, in order, into packs of at most PACK_MAX_BYTES of chunk
    data (a bigger chunk gets a pack of its own)."""
    groups = []
    start = 0
    while start < len(sizes):
        end, total = start, 0
        while end < len(sizes) and (end == start or total + sizes[end] <= PACK_MAX_BYTES):
            total += sizes[end]
            end += 1
        groups.append(range(start, end))
        start = end
    return groups


def pack_header(chunks: Sequence[tuple[bytes, int]]) -> tuple[bytes, str, tuple[PackEntry, ...]]:
    """The header of a pack holding ``chunks`` ((digest, size) each, their bytes following
    the header in this order), the pack's file name, and its entries."""
    offset = len(PACK_MAGIC) + PACK_COUNT.size + len(chunks) * PACK_ENTRY.size
    entries = []
    for digest, size in chunks:
        entries.append((digest, offset, size))
        offset += size
    header = (
        PACK_MAGIC + PACK_COUNT.pack(len(entries)) + b"".join(PACK_ENTRY.pack(*e) for e in entries)
    )
    return header, hashlib.sha256(header).hexdigest(), tuple(entries)


class DamagedPack(ValueError):
    """A pack whose header cannot be trusted; ``str(e)`` says what is wrong with it."""


def read_pack_header(f: BinaryIO, size: int) -> bytes:
    """The header at the start of an open pack file of ``size`` bytes, as far as the file
    holds it. ValueError if the file does not start like a pack of this version, or
    announces more entries than it could hold."""
    head = f.read(len(PACK_MAGIC) + PACK_COUNT.size)
    if len(head) < len(PACK_MAGIC) + PACK_COUNT.size or not head.startswith(PACK_MAGIC):
        raise ValueError("not a moshpit pack of this version")
    (count,) = PACK_COUNT.unpack_from(head, len(PACK_MAGIC))
    if count * PACK_ENTRY.size > size:
        raise ValueError("entry count past the end of the file")
    return head + f.read(count * PACK_ENTRY.size)


def pack_entries(header: bytes, name: str, size: int) -> tuple[PackEntry, ...]:
    """The entries of the pack file ``name`` of ``size`` bytes, from its header
    (:func:`read_pack_header`). DamagedPack if the header is cut short or does not hash to
    the name, or an entry points outside the file's chunk data."""
    start = len(PACK_MAGIC) + PACK_COUNT.size
    (count,) = PACK_COUNT.unpack_from(header, len(PACK_MAGIC))
    table = header[start:]
    if len(table) != count * PACK_ENTRY.size or hashlib.sha256(header).hexdigest() != name:
        raise DamagedPack("has a damaged header")
    entries = tuple(PACK_ENTRY.iter_unpack(table))
    for _, offset, length in entries:
        if offset < len(header) or offset + length > size or length > MAX_CHUNK_BYTES:
            raise DamagedPack("has a bad entry")
    return entries


# ---------------------------------------------------------------------- LATEST


def format_latest(history: Sequence[bytes]) -> bytes:
    """LATEST naming the committed roots ``history``, newest first."""
    body = f"{LATEST_MAGIC} {STORE_FORMAT_VERSION}\n" + "".join(f"{r.hex()}\n" for r in history)
    check = hashlib.sha256(body.encode()).hexdigest()
    return (body + f"sha256 {check}\n").encode()


def parse_latest(data: bytes, path: pathlib.Path) -> list[bytes]:
    """Parse LATEST strictly: a newer format is CheckpointFormatError, anything else that is
    not exactly what format_latest writes is CheckpointCorruptError."""
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


def read_latest(layout: CheckpointLayout) -> list[bytes]:
    """The committed roots LATEST names, newest first (NoCheckpointError if there is no
    LATEST, CheckpointCorruptError or CheckpointFormatError as :func:`parse_latest`)."""
    try:
        with open(layout.latest, "rb") as f:
            data = f.read(MAX_LATEST_BYTES + 1)
    except FileNotFoundError:
        raise NoCheckpointError(f"no checkpoint in {layout.directory} yet") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {layout.latest}: {e}") from None
    return parse_latest(data, layout.latest)


# ---------------------------------------------------------------------- manifests


def read_manifest(layout: CheckpointLayout, root: bytes) -> Manifest:
    """The manifest file of ``root``, verified against it (NoCheckpointError if absent,
    CheckpointCorruptError if damaged, CheckpointFormatError if of another version)."""
    if not isinstance(root, bytes) or len(root) != DIGEST_BYTES:
        raise ValueError(f"a state root is {DIGEST_BYTES} bytes")
    path = layout.manifest_path(root)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise NoCheckpointError(f"no manifest {root.hex()} in {layout.directory}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read manifest {path}: {e}") from None
    if hashlib.sha256(data).digest() != root:
        raise CheckpointCorruptError(
            f"manifest {path} is truncated or damaged (its bytes do not hash to its name); "
            "restore this checkpoint from a backup or download the state from peers"
        )
    try:
        return Manifest.from_bytes(data)
    except ManifestError as e:
        _check_manifest_version(data, path)  # an authentic manifest of another version?
        raise CheckpointCorruptError(f"manifest {path} is not a valid manifest: {e}") from None


def manifest_file_intact(path: str, name: str) -> bool:
    """Do the file's bytes hash to its name (an unreadable file counts as damaged)?"""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == name


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
