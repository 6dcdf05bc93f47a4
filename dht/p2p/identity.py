"""Peer identity: an Ed25519 key pair and the libp2p PeerID derived from its public key.

Wire rules (libp2p peer-id spec): the public key is serialized as the protobuf message
``PublicKey{Type=1 (KeyType), Data=2 (bytes)}``; when that serialization is at most 42 bytes
(always, for Ed25519: 36 bytes) the PeerID is its *identity* multihash (code 0x00, i.e. the
key itself, not a hash), shown as base58btc text (``12D3KooW...``). A PeerID therefore embeds
the public key, so signatures can be checked from the PeerID alone.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from dht.filelock import ExclusiveFileLock

from ._proto import (
    WIRE_LEN,
    WIRE_VARINT,
    ProtobufDecodeError,
    encode_bytes_field,
    encode_varint_field,
    iter_fields,
)
from .errors import IdentityError, IdentityInUseError
from .varint import decode_uvarint, encode_uvarint

logger = logging.getLogger(__name__)

KEY_TYPE_RSA = 0
KEY_TYPE_ED25519 = 1
KEY_TYPE_SECP256K1 = 2
KEY_TYPE_ECDSA = 3
_KEY_TYPE_NAMES = {0: "RSA", 1: "Ed25519", 2: "Secp256k1", 3: "ECDSA"}

MULTIHASH_IDENTITY = 0x00
MULTIHASH_SHA2_256 = 0x12
MAX_INLINE_KEY_LENGTH = 42  # spec: keys serializing to <= 42 bytes are inlined (identity hash)
MAX_PEER_ID_BYTES = 128  # far above any real PeerID (identity <= 44, sha2-256 = 34)
MAX_PUBLIC_KEY_PROTO_BYTES = 4096  # RSA-4096 keys are ~550 bytes; anything larger is hostile
_CIDV1 = 0x01
_CODEC_LIBP2P_KEY = 0x72

# ---------------------------------------------------------------------------------------------
# base58btc (Bitcoin alphabet), as used for PeerID text. Inputs are tiny, so the quadratic
# big-integer conversion is fine; the caller caps lengths before calling.

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}


def b58encode(data: bytes) -> str:
    """Encode bytes as base58btc; each leading zero byte becomes a leading '1'."""
    zeros = len(data) - len(data.lstrip(b"\0"))
    n = int.from_bytes(data, "big")
    chars = []
    while n:
        n, rem = divmod(n, 58)
        chars.append(_B58_ALPHABET[rem])
    return "1" * zeros + "".join(reversed(chars))


def b58decode(text: str) -> bytes:
    """Decode base58btc text; raises ValueError naming the first invalid character."""
    n = 0
    for pos, c in enumerate(text):
        digit = _B58_INDEX.get(c)
        if digit is None:
            raise ValueError(f"invalid base58 character {c!r} at position {pos}")
        n = n * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\0" * zeros + body


# ---------------------------------------------------------------------------------------------
# The libp2p crypto PublicKey protobuf


def encode_public_key(raw_ed25519: bytes, key_type: int = KEY_TYPE_ED25519) -> bytes:
    """Canonical protobuf ``PublicKey`` encoding (field 1 then field 2, as the spec requires)."""
    if key_type == KEY_TYPE_ED25519 and len(raw_ed25519) != 32:
        raise IdentityError(f"an Ed25519 public key is 32 bytes, got {len(raw_ed25519)}")
    return encode_varint_field(1, key_type) + encode_bytes_field(2, raw_ed25519)


def decode_public_key_proto(data: bytes) -> tuple[int, bytes]:
    """Parse a protobuf ``PublicKey`` into ``(key_type, key_data)`` without judging the type."""
    if len(data) > MAX_PUBLIC_KEY_PROTO_BYTES:
        raise IdentityError(f"encoded public key too large ({len(data)} bytes)")
    key_type: int | None = None
    key_data: bytes | None = None
    try:
        for field, wire, value in iter_fields(data):
            if field == 1 and wire == WIRE_VARINT:
                key_type = int(value)
            elif field == 2 and wire == WIRE_LEN:
                key_data = bytes(value)
            # unknown fields are ignored, as protobuf requires
    except ProtobufDecodeError as e:
        raise IdentityError(f"malformed PublicKey protobuf: {e}") from None
    if key_type is None or key_data is None:
        raise IdentityError("PublicKey protobuf lacks its required Type or Data field")
    return key_type, key_data


def decode_public_key(data: bytes) -> bytes:
    """Parse a protobuf ``PublicKey`` and return the raw 32-byte Ed25519 key.

    Raises IdentityError for malformed input or any key type other than Ed25519 (the only
    type this project supports).
    """
    key_type, key_data = decode_public_key_proto(data)
    if key_type != KEY_TYPE_ED25519:
        name = _KEY_TYPE_NAMES.get(key_type, f"unknown type {key_type}")
        raise IdentityError(f"unsupported public key type {name}: only Ed25519 is supported")
    if len(key_data) != 32:
        raise IdentityError(f"Ed25519 public key must be 32 bytes, got {len(key_data)}")
    return key_data


def verify_ed25519(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``data`` by ``public_key``."""
    if len(signature) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


# ---------------------------------------------------------------------------------------------


def _validate_multihash(data: bytes) -> None:
    if not data:
        raise IdentityError("empty PeerID")
    if len(data) > MAX_PEER_ID_BYTES:
        raise IdentityError(f"PeerID too long ({len(data)} bytes, max {MAX_PEER_ID_BYTES})")
    try:
        code, pos = decode_uvarint(data)
        length, pos = decode_uvarint(data, pos)
    except ValueError as e:
        raise IdentityError(f"PeerID is not a multihash: {e}") from None
    if len(data) - pos != length:
        raise IdentityError(
            f"PeerID multihash declares a {length}-byte digest but carries {len(data) - pos} bytes"
        )
    if code == MULTIHASH_IDENTITY:
        if length > MAX_INLINE_KEY_LENGTH:
            raise IdentityError(f"identity-multihash PeerID longer than 42 bytes ({length})")
        decode_public_key_proto(data[pos:])  # must at least be a well-formed key
    elif code == MULTIHASH_SHA2_256:
        if length != 32:
            raise IdentityError(f"sha2-256 PeerID digest must be 32 bytes, got {length}")
    else:
        raise IdentityError(f"PeerID uses unsupported multihash code 0x{code:x}")


@dataclass(frozen=True)
class _TextForm:
    """The fixed shape of one kind of PeerID text: every key of the kind gives ``prefix`` and
    ``length``, so a pasted ID of that kind with another length was cut short or padded."""

    kind: str
    prefix: str
    length: int


def _text_form(kind: str, lowest: bytes, highest: bytes) -> _TextForm:
    """Derive the shape from the smallest and largest multihash of a kind (not hard-coded)."""
    low, high = b58encode(lowest), b58encode(highest)
    assert len(low) == len(high), kind  # one length for every key of the kind
    return _TextForm(kind, os.path.commonprefix([low, high]), len(low))


def _identity_multihash(key_proto: bytes) -> bytes:
    return encode_uvarint(MULTIHASH_IDENTITY) + encode_uvarint(len(key_proto)) + key_proto


_SHA2_256_PREFIX = encode_uvarint(MULTIHASH_SHA2_256) + encode_uvarint(32)
# Ed25519 first: it is what this project generates (12D3KooW..., 52 characters).
_TEXT_FORMS = (
    _text_form(
        "an Ed25519",
        _identity_multihash(encode_public_key(b"\0" * 32)),
        _identity_multihash(encode_public_key(b"\xff" * 32)),
    ),
    _text_form(
        "a Secp256k1",  # compressed keys: 0x02 or 0x03, then 32 bytes
        _identity_multihash(encode_public_key(b"\x02" + b"\0" * 32, KEY_TYPE_SECP256K1)),
        _identity_multihash(encode_public_key(b"\x03" + b"\xff" * 32, KEY_TYPE_SECP256K1)),
    ),
    _text_form(
        "a legacy (sha2-256)", _SHA2_256_PREFIX + b"\0" * 32, _SHA2_256_PREFIX + b"\xff" * 32
    ),
)


def _explain_bad_text(text: str, error: IdentityError) -> str:
    """Say why base58 ``text`` is no PeerID in terms a user can act on.

    Base58 has no checksum: a copy-paste that lost (or gained) characters decodes to bytes
    whose multihash header is garbage, so the header's complaint ("declares a 2-byte digest")
    tells the user nothing. The text's prefix does tell which kind of PeerID was meant, and
    each kind has one fixed length.
    """
    for form in _TEXT_FORMS:
        if not (text.startswith(form.prefix) or form.prefix.startswith(text)):
            continue
        shape = (
            f"{form.kind} PeerID is {form.length} characters "
            f"({form.prefix} + {form.length - len(form.prefix)} more), this one has {len(text)}"
        )
        if len(text) < form.length:
            return f"it looks truncated: {shape}; copy the whole PeerID"
        if len(text) > form.length:
            return f"it is too long: {shape}; remove the extra characters"
        break  # the right length yet invalid: a mistyped character; the error says where
    ed25519, legacy = _TEXT_FORMS[0], _TEXT_FORMS[-1]
    return (
        f"{error}; a PeerID is {ed25519.length} characters starting with {ed25519.prefix} "
        f"(Ed25519) or {legacy.length} starting with {legacy.prefix} (legacy): "
        "check that it was copied whole"
    )


class PeerID:
    """A libp2p peer identifier: the multihash of a protobuf-encoded public key.

    Immutable, hashable, and ordered by its bytes (so sorting peers is deterministic across
    implementations).
    """

    __slots__ = ("_bytes", "_b58")
    _bytes: bytes
    _b58: str | None

    def __init__(self, multihash: bytes) -> None:
        multihash = bytes(multihash)
        _validate_multihash(multihash)
        object.__setattr__(self, "_bytes", multihash)
        object.__setattr__(self, "_b58", None)

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def from_bytes(cls, data: bytes) -> PeerID:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise IdentityError(f"PeerID bytes must be bytes, not {type(data).__name__}")
        return cls(bytes(data))

    @classmethod
    def from_base58(cls, text: str) -> PeerID:
        """Parse the usual text form (``12D3KooW...`` or legacy ``Qm...``)."""
        if not isinstance(text, str):
            raise IdentityError(f"PeerID text must be str, not {type(text).__name__}")
        if not text or len(text) > 2 * MAX_PEER_ID_BYTES:
            raise IdentityError(f"invalid PeerID {text[:80]!r}: bad length {len(text)}")
        try:
            raw = b58decode(text)
        except ValueError as e:
            raise IdentityError(
                f"invalid PeerID {text!r}: {e} "
                "(base58 uses letters and digits except 0, O, I and l)"
            ) from None
        try:
            return cls(raw)
        except IdentityError as e:
            raise IdentityError(f"invalid PeerID {text!r}: {_explain_bad_text(text, e)}") from None

    @classmethod
    def from_string(cls, text: str) -> PeerID:
        """Parse base58btc text or the CIDv1 form (``bafz...``, base32 multibase 'b')."""
        if isinstance(text, str) and text.startswith("b") and len(text) <= 4 * MAX_PEER_ID_BYTES:
            try:
                body = text[1:].upper()
                raw = base64.b32decode(body + "=" * (-len(body) % 8))
                version, pos = decode_uvarint(raw)
                codec, pos = decode_uvarint(raw, pos)
            except (ValueError, TypeError) as e:
                raise IdentityError(f"invalid CID PeerID {text!r}: {e}") from None
            if version != _CIDV1 or codec != _CODEC_LIBP2P_KEY:
                raise IdentityError(f"CID {text!r} is not a CIDv1 libp2p-key")
            return cls(raw[pos:])
        return cls.from_base58(text)

    @classmethod
    def from_public_key(cls, raw_ed25519: bytes) -> PeerID:
        return cls.from_public_key_proto(encode_public_key(raw_ed25519))

    @classmethod
    def from_public_key_proto(cls, encoded: bytes) -> PeerID:
        """PeerID of a protobuf-encoded public key (identity multihash if <= 42 bytes)."""
        if len(encoded) <= MAX_INLINE_KEY_LENGTH:
            digest_prefix = encode_uvarint(MULTIHASH_IDENTITY) + encode_uvarint(len(encoded))
            return cls(digest_prefix + encoded)
        digest = hashlib.sha256(encoded).digest()
        return cls(encode_uvarint(MULTIHASH_SHA2_256) + encode_uvarint(32) + digest)

    # -- accessors -----------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        return self._bytes

    def to_base58(self) -> str:
        if self._b58 is None:
            object.__setattr__(self, "_b58", b58encode(self._bytes))
        return self._b58  # type: ignore[return-value]

    def short(self) -> str:
        """A compact form for logs: the last 6 characters of the base58 text."""
        return self.to_base58()[-6:]

    def public_key_proto(self) -> bytes:
        """The embedded protobuf PublicKey; IdentityError if the PeerID is a hash of it."""
        code, pos = decode_uvarint(self._bytes)
        if code != MULTIHASH_IDENTITY:
            raise IdentityError(f"PeerID {self} is a hash and does not embed its public key")
        _, pos = decode_uvarint(self._bytes, pos)
        return self._bytes[pos:]

    def public_key_bytes(self) -> bytes:
        """The raw 32-byte Ed25519 key embedded in this PeerID (IdentityError otherwise)."""
        return decode_public_key(self.public_key_proto())

    def verify(self, data: bytes, signature: bytes) -> bool:
        """Check an Ed25519 signature against the key embedded in this PeerID.

        Returns False (never raises) for a bad signature and for PeerIDs that do not embed an
        Ed25519 key, since such a signature cannot be attributed to this peer.
        """
        try:
            key = self.public_key_bytes()
        except IdentityError:
            return False
        return verify_ed25519(key, bytes(data), bytes(signature))

    # -- value semantics -----------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("PeerID is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("PeerID is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (PeerID, (self._bytes,))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PeerID):
            return NotImplemented
        return self._bytes == other._bytes

    def __lt__(self, other: PeerID) -> bool:
        if not isinstance(other, PeerID):
            return NotImplemented
        return self._bytes < other._bytes

    def __le__(self, other: PeerID) -> bool:
        if not isinstance(other, PeerID):
            return NotImplemented
        return self._bytes <= other._bytes

    def __gt__(self, other: PeerID) -> bool:
        if not isinstance(other, PeerID):
            return NotImplemented
        return self._bytes > other._bytes

    def __ge__(self, other: PeerID) -> bool:
        if not isinstance(other, PeerID):
            return NotImplemented
        return self._bytes >= other._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)

    def __str__(self) -> str:
        return self.to_base58()

    def __repr__(self) -> str:
        return f"PeerID({self.to_base58()})"


class Identity:
    """This peer's Ed25519 key pair. Keep it secret; share ``peer_id``."""

    __slots__ = ("_private_key", "_public_key_bytes", "_peer_id")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise IdentityError(f"identity key must be Ed25519, got {type(private_key).__name__}")
        self._private_key = private_key
        self._public_key_bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self._peer_id = PeerID.from_public_key(self._public_key_bytes)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic identity from a 32-byte Ed25519 seed (tests, key import)."""
        if len(seed) != 32:
            raise IdentityError(f"an Ed25519 seed is 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    @classmethod
    def from_pem(cls, pem: bytes, *, source: str = "<bytes>") -> Identity:
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:
            raise IdentityError(
                f"identity file {source} is not an unencrypted PEM/PKCS8 private key: {e}"
            ) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError(
                f"identity file {source} holds a {type(key).__name__}, not an Ed25519 key; "
                "delete it to generate a new identity"
            )
        return cls(key)

    def to_pem(self) -> bytes:
        return self._private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key at ``path``, or create one there (mode 0600, atomically) if missing.

        Reusing the file across restarts keeps the PeerID stable. Two processes racing to
        create the same file end up sharing the one that was linked into place first.
        """
        path = Path(path)
        try:
            pem = path.read_bytes()
        except FileNotFoundError:
            return cls._create_at(path)
        except OSError as e:
            raise IdentityError(f"cannot read identity file {path}: {e}") from None
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning(
                "identity file %s is accessible by other users (mode %o); chmod 600 it",
                path,
                stat.S_IMODE(mode),
            )
        return cls.from_pem(pem, source=str(path))

    @classmethod
    @contextlib.contextmanager
    def locked(cls, path: str | os.PathLike[str]) -> Iterator[Identity]:
        """``load_or_create(path)``, holding an :class:`IdentityLock` on it until the block exits.

        What a long-running peer should use: a second live process (or a second peer in this
        one) given the same key file gets :class:`IdentityInUseError` instead of silently
        sharing this PeerID. A restart after any exit, SIGKILL included, is not blocked.
        """
        identity = cls.load_or_create(path)  # creates it if missing: the lock needs the file
        with IdentityLock(path):
            yield identity

    @classmethod
    def _create_at(cls, path: Path) -> Identity:
        try:
            return cls._create_file(path)
        except OSError as e:  # an unwritable directory, a full disk
            raise IdentityError(f"cannot create identity file {path}: {e.strerror or e}") from None

    @classmethod
    def _create_file(cls, path: Path) -> Identity:
        identity = cls.generate()
        directory = path.parent
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(identity.to_pem())
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp_name, path)  # fails if someone created the file meanwhile
            except FileExistsError:
                return cls.from_pem(path.read_bytes(), source=str(path))
            except OSError:
                os.replace(tmp_name, path)  # filesystems without hard links
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
        logger.info("created new identity %s at %s", identity.peer_id, path)
        return identity

    @property
    def peer_id(self) -> PeerID:
        return self._peer_id

    @property
    def public_key_bytes(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        return self._public_key_bytes

    @property
    def public_key_proto(self) -> bytes:
        """The protobuf-encoded libp2p PublicKey (what Noise sends as identity_key)."""
        return encode_public_key(self._public_key_bytes)

    @property
    def private_key(self) -> Ed25519PrivateKey:
        return self._private_key

    def sign(self, data: bytes) -> bytes:
        return self._private_key.sign(bytes(data))

    def __repr__(self) -> str:
        return f"Identity({self._peer_id})"


# ---------------------------------------------------------------------------------------------
# One key file, one live peer


class IdentityLock(ExclusiveFileLock):
    """An exclusive lock on a key file while this process uses the key (see
    :mod:`dht.filelock`).

    Two live peers with one key file share one PeerID, and the DHT then routes to whichever
    answers: both misbehave with no error anywhere. The lock is on the key file itself, so it
    also works where only the key can be read (a read-only secret mount).
    """

    def open_error(self, error: OSError) -> Exception:
        return IdentityError(f"cannot open identity file {self.path}: {error.strerror or error}")

    def in_use_error(self, pid: int | None) -> Exception:
        advice = (
            "two peers must not share one PeerID; {} or use a different key file "
            "(--identity / identity_path)"
        )
        if pid == os.getpid():
            message = (
                f"identity file {self.path} is already in use by a peer in this process "
                f"(pid {pid}): " + advice.format("shut that peer down first")
            )
        else:
            holder = f" (pid {pid})" if pid is not None else ""
            message = (
                f"identity file {self.path} is in use by another running process{holder}: "
                + advice.format("stop that process")
            )
        return IdentityInUseError(message, path=self.path, pid=pid)
