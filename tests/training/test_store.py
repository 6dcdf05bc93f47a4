"""StateStore: content-addressed checkpoints, verification, versions, garbage collection."""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest
import torch

from moshpit.training import store_durable  # the process-wide state tests reset
from moshpit.training.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    NoCheckpointError,
)
from moshpit.training.manifest import Manifest, build_manifest, chunk_digest
from moshpit.training.store import (
    PACK_COUNT,
    PACK_ENTRY,
    PACK_MAGIC,
    StateStore,
    load_state,
    save_state,
)

CHUNK = 4096  # small chunks so that the tests' tensors span several


def named_state(seed: int, scale: int = 1) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("layer.weight", torch.randn(64 * scale, 48, generator=gen)),
        ("layer.bias", torch.randn(48, generator=gen).to(torch.bfloat16)),
        ("step", torch.tensor(seed, dtype=torch.int64)),
        ("mask", torch.rand(33, generator=gen) > 0.5),
        ("empty", torch.zeros(0, 7, dtype=torch.float16)),
        ("codes", torch.randint(-128, 127, (5000,), generator=gen, dtype=torch.int8)),
    ]


def assert_same(named: list[tuple[str, torch.Tensor]], tensors: list[torch.Tensor]) -> None:
    assert len(named) == len(tensors)
    for (name, want), got in zip(named, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name


def chunk_files(directory: pathlib.Path) -> dict[str, tuple[int, int]]:
    """chunk name -> (inode, mtime_ns): a rewrite (tmp + rename) gives a new inode."""
    out = {}
    for path in (directory / "chunks").rglob("*"):
        if path.is_file():
            st = path.stat()
            out[path.name] = (st.st_ino, st.st_mtime_ns)
    return out


def latest_file(roots: list[bytes]) -> bytes:
    """LATEST as docs/training-state.md specifies it."""
    body = "moshpit-checkpoint 1\n" + "".join(f"{r.hex()}\n" for r in roots)
    return f"{body}sha256 {hashlib.sha256(body.encode()).hexdigest()}\n".encode()


def chunk_path(directory: pathlib.Path, digest: bytes) -> pathlib.Path:
    return directory / "chunks" / digest.hex()[:2] / digest.hex()


def test_save_and_load_round_trip_every_dtype(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    named = named_state(1)
    # a non-contiguous tensor is saved by value
    named.append(("transposed", torch.arange(12.0).reshape(3, 4).t()))
    manifest = save_state(store, named, 7, {"lr": 0.1, "note": "x"}, chunk_bytes=CHUNK)
    # the same manifest (and root) as the shared contract's build_manifest
    assert manifest.root == build_manifest(named, 7, {"lr": 0.1, "note": "x"}, CHUNK)[0].root

    loaded, tensors = load_state(StateStore(tmp_path))
    assert loaded == manifest and loaded.root == manifest.root
    assert loaded.epoch == 7 and dict(loaded.metadata) == {"lr": 0.1, "note": "x"}
    assert_same(named, tensors)
    assert store.committed_roots() == [manifest.root]
    assert store.missing_chunks(manifest) == {}
    assert (tmp_path / "LATEST").read_bytes() == latest_file([manifest.root])
    assert (tmp_path / "manifests" / manifest.root.hex()).read_bytes() == manifest.to_bytes()


def test_save_with_explicit_chunks_and_latest(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    with pytest.raises(NoCheckpointError):
        store.latest()
    with pytest.raises(NoCheckpointError):
        load_state(store)
    named = named_state(2)
    manifest, chunks = build_manifest(named, 3, chunk_bytes=CHUNK)
    assert store.missing_chunks(manifest) == manifest.chunk_refs()
    store.save(manifest, chunks)
    assert store.latest() == manifest
    assert store.load_manifest(manifest.root) == manifest
    assert_same(named, store.load_tensors(manifest))


def test_unchanged_tensors_are_not_rewritten(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path, keep=2)
    first = named_state(3, scale=4)
    m1 = save_state(store, first, 1, chunk_bytes=CHUNK)
    before = chunk_files(tmp_path)
    assert set(before) == {d.hex() for d in m1.chunk_refs()}

    # only the weight changes (one chunk's worth of it): every other chunk file stays as it was
    second = [(n, t.clone()) for n, t in first]
    second[0][1][0, 0] += 1.0
    m2 = save_state(store, second, 2, chunk_bytes=CHUNK)
    after = chunk_files(tmp_path)
    new = set(m2.chunk_refs()) - set(m1.chunk_refs())
    assert len(new) == 1
    assert set(after) == set(before) | {d.hex() for d in new}
    for name, stamp in before.items():
        assert after[name] == stamp, "an unchanged chunk was rewritten"

    # saving the same state again writes no chunk at all
    m3 = save_state(store, second, 2, chunk_bytes=CHUNK)
    assert m3.root == m2.root and chunk_files(tmp_path) == after
    # explicit save() skips present chunks too (the chunks it would write are not even read)
    manifest, chunks = build_manifest(second, 5, chunk_bytes=CHUNK)
    present = {d: memoryview(b"never read") for d in chunks}
    store.save(manifest, present)
    final = chunk_files(tmp_path)  # m1's own chunk is collected now (keep=2: m5, m2)
    assert set(final) == {d.hex() for d in manifest.chunk_refs()}
    assert all(final[name] == after[name] for name in final)


def test_identical_chunks_within_a_state_are_stored_once(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    zeros = [(f"z{i}", torch.zeros(4 * CHUNK // 4)) for i in range(3)]
    manifest = save_state(store, zeros, 0, chunk_bytes=CHUNK)
    assert len(manifest.chunk_refs()) == 1
    assert len(chunk_files(tmp_path)) == 1
    assert_same(zeros, load_state(store)[1])


def test_corrupt_chunk_names_the_tensor_and_is_removed(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    named = named_state(4)
    manifest = save_state(store, named, 1, chunk_bytes=CHUNK)
    spec = manifest.tensors[5]  # "codes": two chunks; damage the second one
    path = chunk_path(tmp_path, spec.chunks[1].digest)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="'codes'") as info:
        load_state(store)
    assert "does not match its digest" in str(info.value)
    # removed, so missing_chunks() reports it and a download can replace it
    assert not path.exists()
    assert store.missing_chunks(manifest) == {spec.chunks[1].digest: spec.chunks[1].size}
    with pytest.raises(CheckpointCorruptError, match="'codes'.*is missing"):
        load_state(store)
    # a peer puts the good chunk back: the checkpoint loads again
    good = build_manifest(named, 1, chunk_bytes=CHUNK)[1][spec.chunks[1].digest]
    store.put_chunk(spec.chunks[1].digest, good)
    assert_same(named, load_state(store)[1])


def test_truncated_chunk_names_the_tensor(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    manifest = save_state(store, named_state(5), 1, chunk_bytes=CHUNK)
    spec = manifest.tensors[0]
    path = chunk_path(tmp_path, spec.chunks[2].digest)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(CheckpointCorruptError, match="'layer.weight'.*4095 bytes, expected 4096"):
        store.load_tensors(manifest)


def test_truncated_manifest_is_corrupt(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    manifest = save_state(store, named_state(6), 1, chunk_bytes=CHUNK)
    path = tmp_path / "manifests" / manifest.root.hex()
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointCorruptError, match="truncated or damaged"):
        store.latest()
    with pytest.raises(CheckpointCorruptError):
        load_state(store)
    path.unlink()
    with pytest.raises(CheckpointCorruptError, match="manifest is missing"):
        store.latest()


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\x00\xff garbage",
        b"moshpit-checkpoint 1\n",  # torn: no root, no checksum
        b"moshpit-checkpoint 1\n" + b"ab" * 32 + b"\n",  # no checksum line
        b"moshpit-checkpoint one\n",
        b"something-else 1\n",
    ],
)
def test_garbage_latest_is_corrupt(tmp_path: pathlib.Path, garbage: bytes) -> None:
    store = StateStore(tmp_path)
    save_state(store, named_state(7), 1, chunk_bytes=CHUNK)
    (tmp_path / "LATEST").write_bytes(garbage)
    with pytest.raises(CheckpointCorruptError, match="LATEST is damaged"):
        store.latest()


def test_flipped_byte_in_latest_is_corrupt(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    save_state(store, named_state(8), 1, chunk_bytes=CHUNK)
    save_state(store, named_state(9), 2, chunk_bytes=CHUNK)
    latest = tmp_path / "LATEST"
    good = latest.read_bytes()
    # swap the two roots: every line still well formed, only the checksum catches it
    lines = good.split(b"\n")
    lines[1], lines[2] = lines[2], lines[1]
    latest.write_bytes(b"\n".join(lines))
    with pytest.raises(CheckpointCorruptError, match="LATEST is damaged"):
        store.latest()


def test_a_save_replaces_a_damaged_latest(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    save_state(store, named_state(10), 1, chunk_bytes=CHUNK)
    (tmp_path / "LATEST").write_bytes(b"garbage")
    named = named_state(11)
    manifest = save_state(store, named, 2, chunk_bytes=CHUNK)
    assert store.latest() == manifest
    assert_same(named, load_state(store)[1])


def test_unknown_manifest_version_is_a_format_error(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    manifest, chunks = build_manifest(named_state(12), 1, chunk_bytes=CHUNK)
    future = Manifest(manifest.epoch, manifest.tensors, manifest.chunk_bytes, {}, version=2)
    for digest, data in chunks.items():
        store.put_chunk(digest, data)
    # as a newer moshpit would have written it (this one refuses to commit it)
    with pytest.raises(CheckpointError, match="cannot be checkpointed"):
        store.commit(future)
    (tmp_path / "manifests" / future.root.hex()).write_bytes(future.to_bytes())
    (tmp_path / "LATEST").write_bytes(latest_file([future.root]))
    with pytest.raises(CheckpointFormatError, match="state format version 2.*upgrade moshpit"):
        store.latest()
    with pytest.raises(CheckpointFormatError):
        store.load_manifest(future.root)


def test_unknown_store_version_is_a_format_error_and_not_overwritten(
    tmp_path: pathlib.Path,
) -> None:
    store = StateStore(tmp_path)
    save_state(store, named_state(13), 1, chunk_bytes=CHUNK)
    newer = b"moshpit-checkpoint 7\nwhatever a newer moshpit writes\n"
    (tmp_path / "LATEST").write_bytes(newer)
    with pytest.raises(CheckpointFormatError, match="store format version 7.*upgrade moshpit"):
        store.latest()
    with pytest.raises(CheckpointFormatError):
        save_state(store, named_state(14), 2, chunk_bytes=CHUNK)
    assert (tmp_path / "LATEST").read_bytes() == newer


def test_garbage_collection_keeps_the_last_keep_states(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path, keep=2)
    states = [named_state(20 + i) for i in range(4)]
    states[3][2] = states[0][2]  # state 3 shares a tensor with state 0
    manifests = []
    for epoch, named in enumerate(states[:3]):
        manifests.append(save_state(store, named, epoch, chunk_bytes=CHUNK))
    m0, m1, m2 = manifests
    assert store.committed_roots() == [m2.root, m1.root]
    assert sorted(p.name for p in (tmp_path / "manifests").iterdir()) == sorted(
        [m1.root.hex(), m2.root.hex()]
    )
    assert set(chunk_files(tmp_path)) == {d.hex() for d in {**m1.chunk_refs(), **m2.chunk_refs()}}
    with pytest.raises(NoCheckpointError):
        store.load_manifest(m0.root)
    # both kept states load completely
    assert_same(states[1], store.load_tensors(store.load_manifest(m1.root)))
    assert_same(states[2], store.load_tensors(store.latest()))

    # re-committing an older kept state moves it to the front without dropping the other
    store.commit(m1)
    assert store.committed_roots() == [m1.root, m2.root]

    keep1 = StateStore(tmp_path, keep=1)
    m3 = save_state(keep1, states[3], 3, chunk_bytes=CHUNK)
    assert keep1.committed_roots() == [m3.root]
    assert set(chunk_files(tmp_path)) == {d.hex() for d in m3.chunk_refs()}
    assert [p.name for p in (tmp_path / "manifests").iterdir()] == [m3.root.hex()]


def test_collection_removes_orphans_and_dead_writers_tmp_files(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path, keep=1)
    # a process that died mid-write left tmp files, an uncommitted manifest and a chunk
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead_pid = int(dead.stdout)
    leftovers = [
        tmp_path / "chunks" / "ab" / f".tmp-{dead_pid}-00112233",
        tmp_path / "manifests" / f".tmp-{dead_pid}-44556677",
        tmp_path / f".tmp-{dead_pid}-8899aabb",
        tmp_path / "chunks" / "cd" / f".tmp-{os.getpid()}-0000cafe",  # ours, not in flight
    ]
    for path in leftovers:
        path.write_bytes(b"partial")
    orphan = b"orphan chunk"
    orphan_path = chunk_path(tmp_path, chunk_digest(orphan))
    orphan_path.write_bytes(orphan)
    (tmp_path / "manifests" / ("00" * 32)).write_bytes(b"uncommitted")
    # a tmp file of a live process (this test's parent, say) is left alone
    live_tmp = tmp_path / "chunks" / "ef" / f".tmp-{os.getppid()}-0badf00d"
    live_tmp.write_bytes(b"in flight elsewhere")

    manifest = save_state(store, named_state(30), 1, chunk_bytes=CHUNK)
    for path in leftovers:
        assert not path.exists(), path
    assert not orphan_path.exists()
    assert [p.name for p in (tmp_path / "manifests").iterdir()] == [manifest.root.hex()]
    assert live_tmp.exists()


def test_chunks_put_for_a_download_survive_collection_until_committed(
    tmp_path: pathlib.Path,
) -> None:
    downloader = StateStore(tmp_path, keep=1)
    checkpointer = StateStore(tmp_path, keep=1)  # another object on the same directory
    download, chunks = build_manifest(named_state(40), 9, chunk_bytes=CHUNK)
    digests = list(chunks)
    for digest in digests[: len(digests) // 2]:
        downloader.put_chunk(digest, chunks[digest])
    save_state(checkpointer, named_state(41), 1, chunk_bytes=CHUNK)  # collects garbage
    save_state(checkpointer, named_state(42), 2, chunk_bytes=CHUNK)
    for digest in digests[: len(digests) // 2]:
        assert downloader.has_chunk(digest)
    with pytest.raises(CheckpointError, match=r"chunks are not in"):
        downloader.commit(download)
    for digest in digests[len(digests) // 2 :]:
        downloader.put_chunk(digest, chunks[digest])
    assert downloader.missing_chunks(download) == {}
    downloader.commit(download)
    assert downloader.latest() == download
    assert_same(named_state(40), downloader.load_tensors(download))
    # once committed and superseded, its chunks are ordinary garbage again
    later = save_state(checkpointer, named_state(43), 3, chunk_bytes=CHUNK)
    assert set(chunk_files(tmp_path)) == {d.hex() for d in later.chunk_refs()}


def test_read_chunk_never_returns_corrupt_bytes(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = StateStore(tmp_path)
    data = os.urandom(10_000)
    digest = chunk_digest(data)
    assert store.read_chunk(digest) is None
    assert not store.has_chunk(digest)
    store.put_chunk(digest, data)
    assert store.has_chunk(digest)
    assert store.read_chunk(digest) == data

    path = chunk_path(tmp_path, digest)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="moshpit.training.store"):
        assert store.read_chunk(digest) is None
    assert "does not match its digest" in caplog.text
    assert not path.exists() and not store.has_chunk(digest)
    # an empty file (a chunk cut short to nothing) too
    path.write_bytes(b"")
    assert store.read_chunk(digest) is None and not path.exists()


def test_put_chunk_checks_the_digest(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    data = b"x" * 1000
    wrong = hashlib.sha256(b"y").digest()
    with pytest.raises(ValueError, match="do not hash"):
        store.put_chunk(wrong, data)
    assert not store.has_chunk(wrong)
    assert chunk_files(tmp_path) == {}
    with pytest.raises(ValueError):
        store.put_chunk(b"short", data)


def test_save_rejects_chunks_that_do_not_match_the_manifest(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    first = save_state(store, named_state(50), 1, chunk_bytes=CHUNK)
    manifest, chunks = build_manifest(named_state(51), 2, chunk_bytes=CHUNK)
    digest = next(iter(chunks))
    bad = dict(chunks)
    bad[digest] = memoryview(bytes(len(chunks[digest])))  # the tensor changed under us
    with pytest.raises(ValueError, match="modified while it was being saved"):
        store.save(manifest, bad)
    missing = dict(chunks)
    del missing[digest]
    with pytest.raises(CheckpointError, match="neither in the store nor in the chunks"):
        store.save(manifest, missing)
    assert store.latest() == first


def test_concurrent_put_chunk_of_the_same_digest(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    data = os.urandom(3 << 20)
    digest = chunk_digest(data)
    barrier = threading.Barrier(16)
    errors: list[BaseException] = []

    def put() -> None:
        own = StateStore(tmp_path)  # separate objects, one directory
        barrier.wait()
        try:
            own.put_chunk(digest, memoryview(data))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=put) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert store.read_chunk(digest) == data
    assert list((tmp_path / "chunks").rglob(".tmp-*")) == []
    assert list(chunk_files(tmp_path)) == [digest.hex()]


def test_non_durable_store_round_trips(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path, durable=False)
    named = named_state(60)
    save_state(store, named, 1, chunk_bytes=CHUNK)
    assert_same(named, load_state(StateStore(tmp_path))[1])


def test_keep_must_be_positive(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError):
        StateStore(tmp_path, keep=0)


# ---------------------------------------------------------------------- packs of small chunks


def small_state(seed: int, count: int = 40) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(f"norm{i}.weight", torch.randn(100 + i, generator=gen)) for i in range(count)]


def packs(directory: pathlib.Path) -> dict[str, list[tuple[bytes, int, int]]]:
    """Every pack's entries, parsed as docs/training-state.md describes the format."""
    out = {}
    for path in (directory / "packs").iterdir():
        data = path.read_bytes()
        assert data.startswith(PACK_MAGIC)
        (count,) = PACK_COUNT.unpack_from(data, len(PACK_MAGIC))
        start = len(PACK_MAGIC) + PACK_COUNT.size
        header = data[: start + count * PACK_ENTRY.size]
        assert hashlib.sha256(header).hexdigest() == path.name
        out[path.name] = list(PACK_ENTRY.iter_unpack(header[start:]))
    return out


def stored(directory: pathlib.Path) -> set[bytes]:
    loose = {bytes.fromhex(name) for name in chunk_files(directory)}
    return loose | {d for entries in packs(directory).values() for d, _, _ in entries}


def test_small_tensors_share_a_pack(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    big = ("big", torch.randn((2 << 20) // 4 + 1000))  # 2 full 1 MiB chunks and a short one
    named = [*small_state(1), big]
    manifest = save_state(store, named, 1)
    assert manifest.root == build_manifest(named, 1)[0].root
    (entries,) = packs(tmp_path).values()
    small = {ref.digest for spec in manifest.tensors for ref in spec.chunks if ref.size < 1 << 20}
    assert {d for d, _, _ in entries} == small  # 40 small tensors + the big one's tail
    full = {ref.digest for ref in manifest.tensors[-1].chunks if ref.size == 1 << 20}
    assert {bytes.fromhex(n) for n in chunk_files(tmp_path)} == full
    assert_same(named, load_state(StateStore(tmp_path))[1])

    # the serving API does not care where a chunk lives
    other = StateStore(tmp_path)
    _, chunks = build_manifest(named, 1)
    for digest in small:
        assert other.has_chunk(digest)
        assert other.read_chunk(digest) == bytes(chunks[digest])
    assert other.missing_chunks(manifest) == {}

    # explicit save() packs too
    second, chunks = build_manifest(small_state(2), 2)
    store.save(second, chunks)
    assert len(packs(tmp_path)) == 2
    assert_same(small_state(2), store.load_tensors(store.latest()))


def test_unchanged_small_tensors_are_not_repacked(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path, keep=2)
    first = small_state(3)
    save_state(store, first, 1)
    (old,) = packs(tmp_path)
    old_stat = (tmp_path / "packs" / old).stat()
    second = [(n, t + 1 if i < 10 else t) for i, (n, t) in enumerate(first)]
    m2 = save_state(store, second, 2)
    now = packs(tmp_path)
    assert set(now) - {old} and len(now) == 2
    (new,) = set(now) - {old}
    assert {d for d, _, _ in now[new]} == {spec.chunks[0].digest for spec in m2.tensors[:10]}
    same = (tmp_path / "packs" / old).stat()
    assert (same.st_ino, same.st_mtime_ns) == (old_stat.st_ino, old_stat.st_mtime_ns)
    assert_same(second, load_state(store)[1])


def test_mostly_dead_packs_are_repacked_and_dead_ones_removed(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path, keep=1)
    first = small_state(4)
    m1 = save_state(store, first, 1)
    (p1,) = packs(tmp_path)
    # 30 of 40 change: the first pack is a quarter live, so its 10 live chunks move
    second = [(n, t + 1 if i < 30 else t) for i, (n, t) in enumerate(first)]
    m2 = save_state(store, second, 2)
    now = packs(tmp_path)
    assert p1 not in now and len(now) == 2
    assert sorted(len(e) for e in now.values()) == [10, 30]
    assert stored(tmp_path) == set(m2.chunk_refs())
    assert_same(second, load_state(StateStore(tmp_path))[1])
    # everything changes: both packs are dead and removed
    third = [(n, t + 2) for n, t in first]
    m3 = save_state(store, third, 3)
    assert len(packs(tmp_path)) == 1 and stored(tmp_path) == set(m3.chunk_refs())
    assert not set(m1.chunk_refs()) & stored(tmp_path)


def test_corrupt_packed_chunk_names_the_tensor_and_is_not_served(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = StateStore(tmp_path)
    named = small_state(5)
    manifest = save_state(store, named, 1)
    ((name, entries),) = packs(tmp_path).items()
    victim = manifest.tensors[7]
    digest = victim.chunks[0].digest
    (offset,) = [o for d, o, _ in entries if d == digest]
    path = tmp_path / "packs" / name
    data = bytearray(path.read_bytes())
    data[offset + 3] ^= 0x40
    path.write_bytes(bytes(data))

    fresh = StateStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="moshpit.training.store"):
        with pytest.raises(CheckpointCorruptError, match="'norm7.weight'.*does not match"):
            load_state(fresh)
    assert "not used" in caplog.text
    assert fresh.read_chunk(digest) is None
    assert not fresh.has_chunk(digest)
    assert fresh.missing_chunks(manifest) == {digest: victim.chunks[0].size}
    # its neighbours in the pack still serve
    assert fresh.read_chunk(manifest.tensors[8].chunks[0].digest) is not None
    # a peer sends the good chunk: stored loose, which wins over the damaged packed copy
    fresh.put_chunk(digest, build_manifest(named, 1)[1][digest])
    assert_same(named, load_state(fresh)[1])


def test_damaged_pack_header_makes_its_chunks_missing(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = StateStore(tmp_path)
    manifest = save_state(store, small_state(6), 1)
    ((name, _),) = packs(tmp_path).items()
    path = tmp_path / "packs" / name
    data = bytearray(path.read_bytes())
    data[len(PACK_MAGIC) + PACK_COUNT.size + 40] ^= 0x01  # an entry's offset
    path.write_bytes(bytes(data))
    monkeypatch.setattr(store_durable, "_shared", {})  # a new process: no pack index in memory
    fresh = StateStore(tmp_path)
    with pytest.raises(CheckpointCorruptError, match="'norm0.weight'.*is missing"):
        load_state(fresh)
    assert len(fresh.missing_chunks(manifest)) == 40


# ---------------------------------------------------------------------- durability order


def spy_fsync(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the path of every fsynced file or directory (tmp names before their rename)."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fds")
def test_without_syncfs_every_file_and_directory_is_fsynced(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_durable, "_SYNCFS", None)  # as on macOS
    synced = spy_fsync(monkeypatch)
    store = StateStore(tmp_path / "ckpt")
    synced.clear()
    named = [*small_state(7), ("big", torch.randn((2 << 20) // 4))]
    manifest = save_state(store, named, 1)
    root = tmp_path / "ckpt"
    big = [ref.digest.hex() for ref in manifest.tensors[-1].chunks]
    files = [p for p in synced if os.path.basename(p).startswith(".tmp-")]
    dirs = {p for p in synced if os.path.isdir(p)}
    assert len(files) == 2 + 1 + 2  # two loose chunks, one pack, the manifest, LATEST
    assert {str(root / "chunks" / h[:2]) for h in big} | {
        str(root / "packs"),
        str(root / "manifests"),
        str(root),
    } <= dirs
    # LATEST is the last file written and its directory the last thing synced
    assert synced[-1] == str(root)
    assert_same(named, load_state(store)[1])


@pytest.mark.skipif(store_durable._SYNCFS is None, reason="syncfs(2) is Linux-only")
def test_with_syncfs_one_flush_covers_the_chunks(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = store_durable._SYNCFS

    def syncfs(fd: int) -> int:
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(store_durable, "_SYNCFS", syncfs)
    synced = spy_fsync(monkeypatch)
    store = StateStore(tmp_path)
    synced.clear()
    named = [*small_state(8), ("big", torch.randn((2 << 20) // 4))]
    save_state(store, named, 1)
    assert len(calls) == 1
    files = [p for p in synced if os.path.basename(p).startswith(".tmp-")]
    assert len(files) == 2  # only the manifest and LATEST, after the syncfs
    assert_same(named, load_state(store)[1])


@pytest.mark.skipif(store_durable._SYNCFS is None, reason="syncfs(2) is Linux-only")
def test_saving_an_unchanged_state_flushes_nothing_but_the_commit(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = StateStore(tmp_path)
    named = [*small_state(9), ("big", torch.randn((2 << 20) // 4))]
    save_state(store, named, 1)
    calls: list[int] = []
    real = store_durable._SYNCFS
    monkeypatch.setattr(store_durable, "_SYNCFS", lambda fd: calls.append(fd) or real(fd))
    synced = spy_fsync(monkeypatch)
    save_state(store, named, 2)
    assert calls == []
    assert len([p for p in synced if os.path.basename(p).startswith(".tmp-")]) == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_can_checkpoint(tmp_path: pathlib.Path) -> None:
    """The pool's threads do not survive fork: the child must get its own, not hang."""
    store = StateStore(tmp_path / "parent")
    save_state(store, named_state(70), 1)  # the pool exists now
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports by exit status
        code = 1
        try:
            child = StateStore(tmp_path / "child")
            named = named_state(71)
            save_state(child, named, 2)
            assert_same(named, load_state(child)[1])
            assert_same(named_state(70), load_state(store)[1])  # an object from before fork
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in the store")
        threading.Event().wait(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.skipif(store_durable._SYNCFS is None, reason="syncfs(2) is Linux-only")
def test_a_new_process_flushes_files_a_killed_writer_left_before_reusing_them(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    named = [*small_state(10), ("big", torch.randn((2 << 20) // 4))]
    save_state(StateStore(tmp_path), named, 1)
    # a new process: it did not write those chunk files, so it cannot know they are durable
    monkeypatch.setattr(store_durable, "_shared", {})
    calls: list[int] = []
    real = store_durable._SYNCFS
    monkeypatch.setattr(store_durable, "_SYNCFS", lambda fd: calls.append(fd) or real(fd))
    store = StateStore(tmp_path)
    save_state(store, named, 2)  # writes no chunk, yet flushes once
    assert len(calls) == 1
    save_state(store, named, 3)
    assert len(calls) == 1


def test_without_syncfs_a_new_process_fsyncs_every_chunk_directory_once(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    named = small_state(11)
    save_state(StateStore(tmp_path), named, 1)
    monkeypatch.setattr(store_durable, "_shared", {})
    monkeypatch.setattr(store_durable, "_SYNCFS", None)
    synced = spy_fsync(monkeypatch)
    store = StateStore(tmp_path)
    save_state(store, named, 2)
    dirs = {p for p in synced if os.path.isdir(p)}
    assert {str(tmp_path / "chunks" / f"{i:02x}") for i in range(256)} <= dirs
    assert str(tmp_path / "packs") in dirs
    synced.clear()
    save_state(store, named, 3)
    assert not {p for p in synced if "/chunks/" in p}


def test_a_chunk_file_of_the_wrong_size_is_rewritten_by_a_save(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    named = named_state(12)
    manifest = save_state(store, named, 1, chunk_bytes=CHUNK)
    path = chunk_path(tmp_path, manifest.tensors[0].chunks[0].digest)
    path.write_bytes(b"")  # what a power cut can leave of an unsynced file
    save_state(store, named, 2, chunk_bytes=CHUNK)
    assert path.stat().st_size == CHUNK
    assert_same(named, load_state(store)[1])


def test_a_state_that_could_not_be_read_back_is_not_committed(tmp_path: pathlib.Path) -> None:
    store = StateStore(tmp_path)
    first = save_state(store, named_state(13), 1, chunk_bytes=CHUNK)
    twice = [("w", torch.zeros(3)), ("w", torch.ones(3))]
    with pytest.raises(CheckpointError, match="cannot be checkpointed.*'w' appears twice"):
        save_state(store, twice, 2)
    manifest, chunks = build_manifest(twice, 2)  # an explicit manifest is parsed back
    with pytest.raises(CheckpointError, match="cannot be checkpointed.*'w' appears twice"):
        store.save(manifest, chunks)
    with pytest.raises(CheckpointError, match="17 dimensions"):
        save_state(store, [("deep", torch.zeros([1] * 17))], 2)
    assert store.latest() == first
