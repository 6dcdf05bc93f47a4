"""The state manifest: canonical bytes, content-addressed chunks, validation of untrusted input."""

from __future__ import annotations

import msgpack
import pytest
import torch

from moshpit.training.errors import ManifestError, StateMismatchError
from moshpit.training.manifest import (
    Manifest,
    build_manifest,
    chunk_digest,
    chunk_views,
    tensor_from_chunks,
)

TENSORS = [
    ("w", torch.arange(3000, dtype=torch.float32).reshape(30, 100)),
    ("step", torch.tensor(7.0)),
    ("empty", torch.zeros(0, 4)),
    ("half", torch.ones(5, dtype=torch.bfloat16)),
    ("mask", torch.tensor([True, False, True])),
    ("count", torch.tensor(12, dtype=torch.int64)),
]


def _raw(manifest: Manifest) -> dict:
    return msgpack.unpackb(manifest.to_bytes(), raw=False)


def _pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_roundtrip_bit_exact_and_root_stable():
    manifest, chunks = build_manifest(
        TENSORS, epoch=5, metadata={"b": 1, "a": [1.5]}, chunk_bytes=4096
    )
    parsed = Manifest.from_bytes(manifest.to_bytes())
    assert parsed.root == manifest.root and parsed.epoch == 5
    assert parsed.metadata == {"a": [1.5], "b": 1}
    for spec, (name, tensor) in zip(parsed.tensors, TENSORS, strict=True):
        assert spec.name == name
        rebuilt = tensor_from_chunks(spec, [chunks[c.digest] for c in spec.chunks])
        assert rebuilt.dtype == tensor.dtype and torch.equal(rebuilt, tensor)
    # 12000 bytes in 4096-byte chunks: 3 chunks, the last one shorter
    assert [c.size for c in parsed.tensors[0].chunks] == [4096, 4096, 3808]
    # metadata key order does not change the root
    again, _ = build_manifest(TENSORS, epoch=5, metadata={"a": [1.5], "b": 1}, chunk_bytes=4096)
    assert again.root == manifest.root
    # any change of epoch or bytes changes it
    changed = [(n, t.clone()) for n, t in TENSORS]
    changed[0][1][0, 0] = -1
    assert build_manifest(changed, 5, chunk_bytes=4096)[0].root != manifest.root
    assert (
        build_manifest(TENSORS, 6, chunk_bytes=4096)[0].root
        != build_manifest(TENSORS, 5, chunk_bytes=4096)[0].root
    )


def test_identical_tensors_share_chunks():
    same = torch.arange(2048, dtype=torch.float32)
    manifest, chunks = build_manifest([("a", same), ("b", same.clone())], 0, chunk_bytes=4096)
    assert len(manifest.chunk_refs()) == 2 == len(chunks)  # 8 KiB each: 2 chunks, shared
    assert all(chunk_digest(data) == digest for digest, data in chunks.items())


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda m: m.update(version=2), "version 2 is not supported"),
        (lambda m: m.update(format="other"), "not a moshpit state manifest"),
        (lambda m: m.update(epoch=-1), "epoch"),
        (lambda m: m.update(epoch=True), "epoch"),
        (lambda m: m.update(chunk_bytes=0), "chunk_bytes"),
        (lambda m: m["tensors"][0].__setitem__(1, "complex64"), "dtype"),
        (lambda m: m["tensors"][0].__setitem__(2, [30, 200]), "chunks listed"),
        (lambda m: m["tensors"][0].__setitem__(2, [1 << 41]), "dimension"),
        (lambda m: m["tensors"][0][3][0].__setitem__(0, b"short"), "digest"),
        (lambda m: m["tensors"][0][3][0].__setitem__(1, 7), "chunk size"),
        (lambda m: m["tensors"][1].__setitem__(0, "w"), "appears twice"),
        (lambda m: m["tensors"].append("junk"), "each tensor entry"),
        (lambda m: m.update(metadata=[1]), "metadata"),
    ],
)
def test_malformed_manifests_are_refused(mutate, match):
    manifest, _ = build_manifest(TENSORS, 1, chunk_bytes=4096)
    raw = _raw(manifest)
    mutate(raw)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_bytes(_pack(raw))


def test_garbage_oversize_and_non_canonical_bytes():
    with pytest.raises(ManifestError, match="msgpack"):
        Manifest.from_bytes(b"\xc1\xff garbage")
    with pytest.raises(ManifestError, match="limit"):
        Manifest.from_bytes(b"\x00" * 100, max_bytes=10)
    with pytest.raises(ManifestError, match="bytes"):
        Manifest.from_bytes("a string")  # type: ignore[arg-type]
    manifest, _ = build_manifest(TENSORS, 1)
    raw = _raw(manifest)
    reordered = {k: raw[k] for k in reversed(list(raw))}  # same content, other byte order
    with pytest.raises(ManifestError, match="canonical"):
        Manifest.from_bytes(_pack(reordered))


def test_check_fits_names_the_first_mismatch():
    manifest, _ = build_manifest(TENSORS, 1)
    schema = manifest.schema()
    manifest.check_fits(schema)
    with pytest.raises(StateMismatchError, match=r"'step' has shape \[\] .* \[1\]"):
        manifest.check_fits([schema[0], ("step", "float32", (1,)), *schema[2:]])
    with pytest.raises(StateMismatchError, match="'half' is bfloat16 .* float16"):
        manifest.check_fits([*schema[:3], ("half", "float16", (5,)), *schema[4:]])
    with pytest.raises(StateMismatchError, match="named 'w' .* 'weight'"):
        manifest.check_fits([("weight", "float32", (30, 100)), *schema[1:]])
    with pytest.raises(StateMismatchError, match="more tensors"):
        manifest.check_fits(schema[:-1])
    with pytest.raises(StateMismatchError, match="fewer tensors"):
        manifest.check_fits([*schema, ("extra", "float32", (1,))])


def test_rebuild_refuses_wrong_chunk_sizes():
    manifest, chunks = build_manifest([("w", torch.ones(10))], 0)
    spec = manifest.tensors[0]
    with pytest.raises(ManifestError, match="chunk of 3 bytes"):
        tensor_from_chunks(spec, [b"abc"])
    with pytest.raises(ManifestError, match="got 2 chunks"):
        tensor_from_chunks(spec, [chunks[spec.chunks[0].digest]] * 2)


def test_chunk_views_of_a_loaded_state_are_the_chunks_it_was_built_from():
    """A verified download is served as it is: the manifest's own cut of the tensors gives
    the same digests and bytes as building the manifest did, without hashing again."""
    manifest, built = build_manifest(TENSORS, epoch=3, chunk_bytes=1024)
    copies = [t.clone() for _, t in TENSORS]  # what a download hands back
    views = chunk_views(manifest, copies)
    assert {d: bytes(v) for d, v in views.items()} == {d: bytes(v) for d, v in built.items()}
    assert all(chunk_digest(v) == d for d, v in views.items())
