"""The bugs fuzzing found, each as a small readable test next to the exact crashing input
(``corpus/<target>/crash-*.bin``, replayed by ``test_decoders`` as an @example)."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch

from compression import CompressedTensor, RandomK, TopK, Uniform8Bit, decompress, decompress_into
from dht.p2p._proto import encode_bytes_field
from dht.p2p.errors import MultiaddrError, ProtocolNegotiationError
from dht.p2p.identify import decode_identify
from dht.p2p.identity import PeerID
from dht.p2p.multiaddr import Multiaddr, parse_multiaddr_list
from dht.p2p.multistream import MULTISTREAM_PROTOCOL, encode_message, list_protocols
from dht.p2p.varint import encode_uvarint
from moshpit.averaging.group_keys import make_group_key, parse_group_key
from moshpit.training.errors import ManifestError
from moshpit.training.manifest import Manifest
from moshpit.training.sharing_protocol import parse_record as _parse_record

from ._harness import CORPUS_DIR, ScriptedStream, load_all
from .targets_p2p import ALICE, BOB, SEED_ADDRS

CRASHES = {
    "allreduce_chunk/crash-topk-fp32-scaled-twice.bin",
    "codec_Uniform8Bit/crash-subnormal-range.bin",
    "donor_records/crash-owner-subkey-trailing-newline.bin",
    "group_key/crash-bits-trailing-newline.bin",
    "identify/crash-listen-addr-only-peer-ids.bin",
    "manifest/crash-chunk-count-bomb.bin",
    "manifest/crash-metadata-deep-nesting.bin",
    "manifest/crash-metadata-mixed-key-types.bin",
    "manifest/crash-unhashable-dtype.bin",
    "multiaddr_text/crash-dns-lone-surrogate.bin",
    "multistream_ls/crash-ls-entry-past-answer.bin",
}


def test_every_crash_file_is_kept_and_belongs_to_a_target() -> None:
    present = {p.relative_to(CORPUS_DIR).as_posix() for p in CORPUS_DIR.glob("*/crash-*.bin")}
    assert CRASHES <= present
    assert {c.split("/")[0] for c in present} <= set(load_all())


def test_dns_name_with_a_lone_surrogate_is_refused() -> None:
    # multiaddr_text/crash-dns-lone-surrogate: b"/dns4/\xb0" is "/dns4/\udcb0" for Python's
    # argv decoding; it parsed, then to_bytes() raised UnicodeEncodeError
    with pytest.raises(MultiaddrError, match="not valid Unicode"):
        Multiaddr("/dns4/\udcb0")
    with pytest.raises(MultiaddrError):
        parse_multiaddr_list(["/dns4/\udcb0/tcp/443"], "initial_peers")


async def test_an_ls_entry_may_not_run_past_the_ls_answer() -> None:
    # multistream_ls/crash-ls-entry-past-answer: an entry claiming 6 bytes in a 4-byte answer
    # used to be completed from the bytes that follow the answer on the stream
    body = encode_uvarint(6) + b"/a\n"
    answer = encode_uvarint(len(body)) + body
    remote = ScriptedStream(encode_message(MULTISTREAM_PROTOCOL) + answer + b"/x\n", chunk=1)
    with pytest.raises(ProtocolNegotiationError, match="runs past the end"):
        await list_protocols(remote, timeout=None)


def test_identify_skips_a_listen_addr_that_is_only_peer_ids() -> None:
    # identify/crash-listen-addr-only-peer-ids: /p2p/A/p2p/A lost its last /p2p and was kept
    # as a "listen address" with no transport (encode_identify then raised on it)
    only_ids = Multiaddr(f"/p2p/{ALICE.peer_id}/p2p/{ALICE.peer_id}").to_bytes()
    body = encode_bytes_field(2, only_ids) + encode_bytes_field(2, SEED_ADDRS[0].to_bytes())
    assert decode_identify(body, ALICE.peer_id).listen_addrs == [SEED_ADDRS[0]]


@pytest.mark.parametrize("key", ["run.0b01\n", "run.0b\n"])
def test_group_key_bits_with_a_trailing_newline_are_refused(key: str) -> None:
    # group_key/crash-bits-trailing-newline: "$" matched before the final newline
    with pytest.raises(ValueError, match="not a group key"):
        parse_group_key(key)
    with pytest.raises(ValueError):
        make_group_key("run", key.rpartition(".0b")[2])


def test_state_record_subkey_has_one_spelling() -> None:
    # donor_records/crash-owner-subkey-trailing-newline: "[owner:<id>]\n" parsed as <id>'s
    value = {"root": bytes(32), "epoch": 1, "bytes": 2, "complete": True}
    subkey = f"[owner:{BOB.peer_id}]"
    assert _parse_record(subkey, value, PeerID.from_base58).peer == BOB.peer_id
    with pytest.raises(ValueError, match="subkey"):
        _parse_record(subkey + "\n", value, PeerID.from_base58)


def _manifest(tensors: list, metadata: object = None, chunk_bytes: int = 16) -> bytes:
    return msgpack.packb(
        {
            "format": "moshpit-state",
            "version": 1,
            "epoch": 0,
            "chunk_bytes": chunk_bytes,
            "tensors": tensors,
            "metadata": {} if metadata is None else metadata,
        },
        use_bin_type=True,
    )


def test_manifest_dtype_must_be_a_string() -> None:
    # manifest/crash-unhashable-dtype: `dtype not in DTYPES` raised TypeError for a list
    with pytest.raises(ManifestError, match="dtype"):
        Manifest.from_bytes(_manifest([["w", ["float32"], [1], [[bytes(32), 4]]]]))


def test_manifest_chunk_count_is_checked_before_the_chunk_list_is_built() -> None:
    # manifest/crash-chunk-count-bomb: a 2**31 x 4 float32 tensor in 16-byte chunks made the
    # parser build a list of 2**31 chunk sizes (MemoryError, or gigabytes) from 360 bytes
    start = time.monotonic()
    with pytest.raises(ManifestError, match="chunks listed"):
        Manifest.from_bytes(_manifest([["w", "float32", [2**31 - 1, 4], []]]))
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize(
    "raw",
    [
        # manifest/crash-metadata-mixed-key-types: str and bytes keys cannot be sorted
        _manifest([], {"a": 1, b"b": 2}),
        # manifest/crash-metadata-deep-nesting: RecursionError while canonicalizing
        _manifest([], {"x": 0}).replace(b"\xa1x\x00", b"\xa1x" + b"\x91" * 700 + b"\x90"),
    ],
    ids=["mixed-key-types", "deep-nesting"],
)
def test_manifest_metadata_without_a_canonical_form_is_refused(raw: bytes) -> None:
    with pytest.raises(ManifestError, match="canonical"):
        Manifest.from_bytes(raw)


@pytest.mark.parametrize("values", [[0.0, 1e-40], [5e-45, 0.0], [-1e-38, 1e-38]])
def test_uniform8bit_encodes_a_very_narrow_range(values: list[float]) -> None:
    # codec_Uniform8Bit/crash-subnormal-range: 1 / step overflowed float32 in the encoder
    # (RuntimeError from torch.add); such a range now decodes to its lower end
    tensor = torch.tensor(values)
    decoded = decompress(Uniform8Bit().compress(tensor))
    assert float((decoded - tensor).abs().max()) <= float(tensor.max() - tensor.min())


@pytest.mark.parametrize("codec_id", [TopK.codec_id, RandomK.codec_id])
def test_float32_sparse_values_with_a_scale_leave_the_payload_alone(codec_id) -> None:
    # allreduce_chunk/crash-topk-fp32-scaled-twice: float32 values (vbits 32) with a scale
    # other than 1 (the encoder always sends 1 there) were scaled in place inside the
    # message's own bytes, so decode_chunk and then decode_chunk_into disagreed
    values = torch.tensor([1.0, -2.0, 3.0, 0.5])
    meta = {"k": 4, "vbits": 32, "scale": 0.25}
    meta.update({"width": 0} if codec_id == TopK.codec_id else {"seed": 3})
    payload = values.numpy().tobytes()  # TopK with width 0: the indices take no bytes
    ct = CompressedTensor.from_msg(
        {"codec": codec_id, "dtype": "float32", "shape": [4], "payload": payload, "meta": meta}, 4
    )
    first = decompress(ct)
    into = torch.empty(4)
    decompress_into(ct, into)
    assert ct.payload == payload and torch.equal(first, into)
    assert torch.equal(first.sort().values, (values * 0.25).sort().values)
