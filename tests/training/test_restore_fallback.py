"""Restoring walks back: a damaged or non-finite newest checkpoint falls back to an older one
that verifies, then to the swarm; damaged files are moved to ``damaged/``, never deleted.

Every fault here is made on disk with real bytes (a flipped byte in a pack, a truncated or
garbled LATEST, a truncated manifest) in a directory written by the real store.
"""

from __future__ import annotations

import logging
import pathlib

import pytest
import torch

from moshpit.training.errors import CheckpointCorruptError, NoCheckpointError
from moshpit.training.health import first_non_finite
from moshpit.training.store import StateStore, load_newest_intact, save_state


def small_state(seed: int, count: int = 20) -> list[tuple[str, torch.Tensor]]:
    """Small tensors: a save packs them into one file of packs/."""
    gen = torch.Generator().manual_seed(seed)
    return [(f"w{i}", torch.randn(64 + i, generator=gen)) for i in range(count)]


def big_state(seed: int) -> list[tuple[str, torch.Tensor]]:
    """One tensor of several loose 4 KiB chunks."""
    gen = torch.Generator().manual_seed(seed)
    return [("weight", torch.randn(4096, generator=gen))]


def two_checkpoints(tmp_path: pathlib.Path, make=small_state, **kw):
    store = StateStore(tmp_path, **kw)
    old = save_state(store, make(1), 1, chunk_bytes=4096)
    new = save_state(store, make(2), 2, chunk_bytes=4096)
    return store, old, new


def flip(path: pathlib.Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def equal(named, tensors) -> bool:
    return all(torch.equal(t, want) for (_, want), t in zip(named, tensors, strict=True))


def damaged(tmp_path: pathlib.Path) -> list[str]:
    folder = tmp_path / "damaged"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_a_flipped_byte_in_the_newest_pack_falls_back_to_the_older_state(tmp_path):
    store, old, new = two_checkpoints(tmp_path)
    newest_pack = max((tmp_path / "packs").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    flip(newest_pack, newest_pack.stat().st_size - 7)  # inside the last packed chunk
    restored = load_newest_intact(StateStore(tmp_path))
    assert restored.manifest.root == old.root
    assert equal(small_state(1), restored.tensors)
    assert len(restored.passed_over) == 1
    assert "does not match its digest" in restored.passed_over[0]
    # nothing was deleted: the damaged pack is still on disk
    assert newest_pack.exists()


def test_a_flipped_byte_in_a_loose_chunk_is_moved_aside(tmp_path):
    store, old, new = two_checkpoints(tmp_path, make=big_state)
    digest = new.tensors[0].chunks[1].digest.hex()
    path = tmp_path / "chunks" / digest[:2] / digest
    flip(path, 100)
    restored = load_newest_intact(StateStore(tmp_path))
    assert restored.manifest.root == old.root
    assert "'weight'" in restored.passed_over[0]
    assert not path.exists()
    (kept,) = damaged(tmp_path)
    assert kept.startswith(f"chunk-{digest}.")


@pytest.mark.parametrize(
    ("damage", "set_aside"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-20]), True),  # truncated
        (lambda p: p.write_bytes(b"\x00garbage\xff" * 3), True),  # garbled
        (lambda p: p.write_bytes(b""), True),  # empty (a crash of a careless tool)
        (lambda p: p.unlink(), False),  # gone
    ],
    ids=["truncated", "garbled", "empty", "missing"],
)
def test_a_damaged_latest_still_restores_the_newest_intact_state(tmp_path, damage, set_aside):
    store, old, new = two_checkpoints(tmp_path)
    damage(tmp_path / "LATEST")
    restored = load_newest_intact(StateStore(tmp_path))
    assert restored.manifest.root == new.root  # manifests/ still names it
    assert restored.passed_over == []  # no newer state was lost ...
    assert bool(restored.notes) == set_aside  # ... but a damaged LATEST is worth a line
    assert equal(small_state(2), restored.tensors)
    # the next commit keeps the older intact states instead of collecting them
    third = save_state(StateStore(tmp_path), small_state(3), 3, chunk_bytes=4096)
    assert StateStore(tmp_path).committed_roots() == [third.root, new.root]
    assert [n.split(".")[0] for n in damaged(tmp_path)] == (["LATEST"] if set_aside else [])


def test_a_garbled_latest_is_kept_aside_when_replaced(tmp_path):
    store, old, new = two_checkpoints(tmp_path)
    (tmp_path / "LATEST").write_bytes(b"not a pointer")
    save_state(StateStore(tmp_path), small_state(3), 3, chunk_bytes=4096)
    (kept,) = damaged(tmp_path)
    assert kept.startswith("LATEST.")
    assert (tmp_path / "damaged" / kept).read_bytes() == b"not a pointer"


def test_a_truncated_newest_manifest_falls_back_and_is_kept_aside(tmp_path):
    store, old, new = two_checkpoints(tmp_path, keep=2)
    path = tmp_path / "manifests" / new.root.hex()
    path.write_bytes(path.read_bytes()[:-10])
    restored = load_newest_intact(StateStore(tmp_path))
    assert restored.manifest.root == old.root
    assert "truncated or damaged" in restored.passed_over[0]
    # two more commits push it out of the history: it is moved aside, not deleted
    save_state(StateStore(tmp_path), small_state(3), 3, chunk_bytes=4096)
    save_state(StateStore(tmp_path), small_state(4), 4, chunk_bytes=4096)
    assert not path.exists()
    assert any(n.startswith(f"manifest-{new.root.hex()}.") for n in damaged(tmp_path))


def test_a_non_finite_newest_state_is_passed_over(tmp_path):
    store = StateStore(tmp_path)
    save_state(store, small_state(1), 1)
    poisoned = small_state(2)
    poisoned[3][1][5] = float("nan")
    save_state(store, poisoned, 2)

    def finite(manifest, tensors):
        bad = first_non_finite((s.name, t) for s, t in zip(manifest.tensors, tensors, strict=True))
        return None if bad is None else f"tensor {bad!r} holds NaN or Inf"

    restored = load_newest_intact(store, accept=finite)
    assert restored.manifest.epoch == 1
    assert restored.passed_over == ["the checkpoint of epoch 2: tensor 'w3' holds NaN or Inf"]


def test_nothing_usable_names_every_problem_and_no_checkpoint_is_its_own_error(tmp_path):
    with pytest.raises(NoCheckpointError):
        load_newest_intact(StateStore(tmp_path / "empty"))
    store, old, new = two_checkpoints(tmp_path)
    for root in (old.root, new.root):
        path = tmp_path / "manifests" / root.hex()
        path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CheckpointCorruptError, match="no usable checkpoint") as info:
        load_newest_intact(StateStore(tmp_path))
    assert str(info.value).count("truncated or damaged") == 2


def test_first_non_finite_names_the_first_bad_tensor():
    named = [
        ("ints", torch.tensor([1, 2])),
        ("ok", torch.ones(3)),
        ("inf", torch.tensor([1.0, float("inf")])),
        ("nan", torch.tensor([float("nan")])),
        ("empty", torch.zeros(0)),
    ]
    assert first_non_finite(named) == "inf"
    assert first_non_finite(named[:2]) is None
    assert first_non_finite([("half", torch.tensor([float("nan")], dtype=torch.bfloat16))]) == "half"


def test_damaged_files_are_reported_in_the_log(tmp_path, caplog):
    store, old, new = two_checkpoints(tmp_path, make=big_state)
    digest = new.tensors[0].chunks[0].digest.hex()
    flip(tmp_path / "chunks" / digest[:2] / digest, 0)
    with caplog.at_level(logging.WARNING, logger="moshpit.training.store"):
        load_newest_intact(StateStore(tmp_path))
    assert "moved to damaged" in caplog.text
