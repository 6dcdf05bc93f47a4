"""Identity and PeerID: libp2p test vectors, codecs, key-file persistence."""

from __future__ import annotations

import os
import pickle
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given
from hypothesis import strategies as st

from dht.p2p.errors import IdentityError
from dht.p2p.identity import (
    Identity,
    PeerID,
    b58decode,
    b58encode,
    decode_public_key,
    encode_public_key,
)

# Vectors from the libp2p peer-id spec / rust-libp2p keypair tests: Ed25519 seed, the
# protobuf PublicKey it must serialize to, and the resulting PeerID text.
SPEC_SEED = bytes.fromhex("7e0830617c4a7de83925dfb2694556b12936c477a0e1feb2e148ec9da60fee7d")
SPEC_PUBKEY_PROTO = bytes.fromhex(
    "080112201ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e"
)
SPEC_PEER_ID = "12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"
# The peer-id spec's example PeerID, its embedded key, and its CIDv1 text form.
EXAMPLE_PEER_ID = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"
EXAMPLE_KEY = bytes.fromhex("2ffa35a99d3a3cfbb17bb7c1dc5561b18a8dcca4df38dc613ea859c37eb1336b")
EXAMPLE_CID = "bafzaajaiaejcal72gwuz2or47oyxxn6b3rkwdmmkrxgkjxzy3rqt5kczyn7lcm3l"
# A legacy RSA PeerID (sha2-256 multihash of the key).
RSA_PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_spec_vector_seed_to_proto_and_peer_id():
    ident = Identity.from_seed(SPEC_SEED)
    assert ident.public_key_proto == SPEC_PUBKEY_PROTO
    assert encode_public_key(ident.public_key_bytes) == SPEC_PUBKEY_PROTO
    assert decode_public_key(SPEC_PUBKEY_PROTO) == ident.public_key_bytes
    assert str(ident.peer_id) == SPEC_PEER_ID
    # identity multihash: code 0x00, length 36, then the protobuf itself
    assert ident.peer_id.to_bytes() == b"\x00\x24" + SPEC_PUBKEY_PROTO


def test_spec_example_peer_id_embeds_key_and_cid_form():
    pid = PeerID.from_base58(EXAMPLE_PEER_ID)
    assert pid.public_key_bytes() == EXAMPLE_KEY
    assert PeerID.from_public_key(EXAMPLE_KEY) == pid
    assert PeerID.from_string(EXAMPLE_CID) == pid
    assert PeerID.from_string(EXAMPLE_PEER_ID) == pid


def test_legacy_sha256_peer_id_parses_but_has_no_key():
    pid = PeerID.from_base58(RSA_PEER_ID)
    assert pid.to_bytes()[:2] == b"\x12\x20"
    assert str(pid) == RSA_PEER_ID
    with pytest.raises(IdentityError, match="hash"):
        pid.public_key_bytes()
    assert pid.verify(b"x", b"\0" * 64) is False


def test_sign_verify_from_peer_id_alone():
    ident = Identity.generate()
    sig = ident.sign(b"hello")
    pid = PeerID.from_base58(str(ident.peer_id))
    assert pid.verify(b"hello", sig)
    assert not pid.verify(b"hellO", sig)
    assert not pid.verify(b"hello", sig[:-1] + bytes([sig[-1] ^ 1]))
    assert not pid.verify(b"hello", sig[:10])
    assert not Identity.generate().peer_id.verify(b"hello", sig)


def test_peer_id_value_semantics():
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    assert a != b and len({a, b, PeerID.from_bytes(a.to_bytes())}) == 2
    assert sorted([a, b]) == sorted([b, a])
    assert (a < b) == (a.to_bytes() < b.to_bytes())
    assert str(a).endswith(a.short()) and len(a.short()) == 6
    assert pickle.loads(pickle.dumps(a)) == a
    with pytest.raises(AttributeError):
        a._bytes = b"x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "bad, match",
    [
        ("", "length"),
        ("12D3KooW0OIl", "base58 character"),
        ("1" * 40, "multihash|digest"),
        ("z" * 300, "length"),
    ],
)
def test_bad_peer_id_text(bad, match):
    with pytest.raises(IdentityError, match=match):
        PeerID.from_base58(bad)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x00",
        b"\x00\x25" + SPEC_PUBKEY_PROTO,  # length mismatch
        b"\x13\x20" + b"\0" * 32,  # unsupported hash (sha2-512 code with 32 bytes)
        b"\x12\x10" + b"\0" * 16,  # sha2-256 with wrong digest size
        b"\x00\x03\x08\x01\x12",  # identity hash of a truncated protobuf
    ],
)
def test_bad_peer_id_bytes(raw):
    with pytest.raises(IdentityError):
        PeerID.from_bytes(raw)


def test_public_key_proto_rejections():
    with pytest.raises(IdentityError, match="Secp256k1"):
        decode_public_key(
            bytes.fromhex(
                "08021221037777e994e452c21604f91de093ce415f5432f701dd8cd1a7a6fea0e630bfca99"
            )
        )
    with pytest.raises(IdentityError, match="32 bytes"):
        decode_public_key(b"\x08\x01\x12\x02ab")
    with pytest.raises(IdentityError, match="required"):
        decode_public_key(b"\x08\x01")
    with pytest.raises(IdentityError, match="malformed"):
        decode_public_key(b"\x08\x01\x12\x20abc")
    # non-canonical field order is still understood
    key = SPEC_PUBKEY_PROTO[4:]
    assert decode_public_key(b"\x12\x20" + key + b"\x08\x01") == key


@given(st.binary(max_size=64))
def test_base58_roundtrip(data):
    assert b58decode(b58encode(data)) == data


def test_base58_known():
    assert b58encode(b"hello world") == "StV1DL6CwTryKyV"
    assert b58encode(b"\0\0\x01") == "112"
    assert b58decode("112") == b"\0\0\x01"


def test_load_or_create_persists_with_0600(tmp_path):
    path = tmp_path / "sub" / "id.pem"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    second = Identity.load_or_create(path)
    assert second.peer_id == first.peer_id
    assert [p.name for p in path.parent.iterdir()] == ["id.pem"]  # no temp files left


def test_load_corrupt_or_wrong_type_file(tmp_path):
    corrupt = tmp_path / "corrupt.pem"
    corrupt.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnot base64!!\n-----END PRIVATE KEY-----\n")
    with pytest.raises(IdentityError, match="not an unencrypted PEM"):
        Identity.load_or_create(corrupt)
    wrong = tmp_path / "ec.pem"
    wrong.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(IdentityError, match="not an Ed25519 key"):
        Identity.load_or_create(wrong)
    assert corrupt.read_bytes().startswith(b"-----BEGIN")  # never overwritten


def test_pem_roundtrip():
    ident = Identity.generate()
    assert Identity.from_pem(ident.to_pem()).peer_id == ident.peer_id


# ------------------------------------------------------------------ PeerID text a user pasted
# An Ed25519 PeerID is the base58btc text of a 38-byte identity multihash: always 52 characters,
# always starting with 12D3KooW (44 more after it); a legacy sha2-256 one is 46, starting Qm.


@pytest.mark.parametrize("keep", [1, 4, 8, 11, 20, 30, 45, 50, 51])
def test_a_truncated_peer_id_says_it_looks_truncated(keep):
    text = str(Identity.generate().peer_id)
    assert len(text) == 52 and text.startswith("12D3KooW")
    cut = text[:keep]
    with pytest.raises(IdentityError) as info:
        PeerID.from_string(cut)
    assert str(info.value) == (
        f"invalid PeerID {cut!r}: it looks truncated: an Ed25519 PeerID is 52 characters "
        f"(12D3KooW + 44 more), this one has {keep}; copy the whole PeerID"
    )


@pytest.mark.parametrize("extra", ["z", "2D", "12D3KooW"])
def test_a_too_long_peer_id_says_how_long_it_should_be(extra):
    text = str(Identity.generate().peer_id) + extra
    with pytest.raises(IdentityError) as info:
        PeerID.from_base58(text)
    assert str(info.value) == (
        f"invalid PeerID {text!r}: it is too long: an Ed25519 PeerID is 52 characters "
        f"(12D3KooW + 44 more), this one has {len(text)}; remove the extra characters"
    )


def test_a_truncated_legacy_peer_id_names_the_legacy_length():
    with pytest.raises(IdentityError, match=r"truncated: a legacy \(sha2-256\) PeerID is 46 "):
        PeerID.from_base58(RSA_PEER_ID[:-1])


@pytest.mark.parametrize("bad", ["0", "O", "I", "l", " ", "…"])
@pytest.mark.parametrize("where", [0, 20, 52])
def test_a_non_base58_character_is_named_with_its_position(bad, where):
    text = str(Identity.generate().peer_id)
    pasted = text[:where] + bad + text[where:]  # an extra character
    replaced = text[:where] + bad + text[where + 1 :]  # a mistyped one
    for candidate in (pasted, replaced):
        with pytest.raises(IdentityError) as info:
            PeerID.from_base58(candidate)
        message = str(info.value)
        assert f"invalid base58 character {bad!r} at position {where}" in message
        assert "except 0, O, I and l" in message


def test_an_unrecognisable_peer_id_says_what_a_peer_id_looks_like():
    with pytest.raises(IdentityError) as info:
        PeerID.from_base58("1" * 40)
    message = str(info.value)
    assert "multihash" in message
    assert "52 characters starting with 12D3KooW" in message and "46 starting with Qm" in message
