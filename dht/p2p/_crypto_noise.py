"""The Noise Protocol Framework state machine for ``Noise_XX_25519_{ChaChaPoly,AESGCM}_SHA256``.

Written from the Noise specification (revision 34): CipherState, SymmetricState and
HandshakeState, restricted to the one handshake pattern libp2p uses::

    XX:
      -> e
      <- e, ee, s, es
      -> s, se

Primitives come from ``cryptography``: X25519 for DH, SHA-256 with HMAC-based HKDF, and one
of two cipher functions (spec section 12), picked per connection by a ``NoiseCipher``:

* ``ChaChaPoly``: ChaCha20-Poly1305, nonce = 4 zero bytes || 64-bit *little*-endian counter
  (libp2p's ``/noise``);
* ``AESGCM``: AES-256-GCM, nonce = 4 zero bytes || 64-bit *big*-endian counter (faster where
  the CPU has AES instructions; moshpit peers negotiate it between themselves).

The cipher's name is part of the protocol name, which seeds ``h`` and ``ck``: two sides that
disagree on the cipher fail the handshake instead of talking past each other. This module
knows nothing about libp2p payloads or sockets; ``noise.py`` drives it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from .errors import HandshakeError

HASHLEN = 32
DHLEN = 32
TAGLEN = 16
MAX_NONCE = 2**64 - 1  # reserved by the spec; reaching it means the session must end

_XX_PATTERN: tuple[tuple[str, ...], ...] = (("e",), ("e", "ee", "s", "es"), ("s", "se"))


@dataclass(frozen=True)
class NoiseCipher:
    """A Noise cipher function: its name in the protocol name, AEAD class and nonce layout."""

    name: str
    aead: type[ChaCha20Poly1305] | type[AESGCM]
    nonce: struct.Struct  # packs the 64-bit counter into the AEAD's 12-byte nonce

    @property
    def protocol_name(self) -> bytes:
        return f"Noise_XX_25519_{self.name}_SHA256".encode()

    def nonce_bytes(self, n: int) -> bytes:
        return self.nonce.pack(n)


CHACHAPOLY = NoiseCipher("ChaChaPoly", ChaCha20Poly1305, struct.Struct("<4xQ"))
AESGCM_256 = NoiseCipher("AESGCM", AESGCM, struct.Struct(">4xQ"))  # 32-byte keys: AES-256
PROTOCOL_NAME = CHACHAPOLY.protocol_name  # libp2p's /noise


def nonce_bytes(n: int) -> bytes:
    """ChaChaPoly nonce: 32 bits of zeros followed by the little-endian 64-bit counter."""
    return CHACHAPOLY.nonce_bytes(n)


def _raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def x25519_public_bytes(key: X25519PrivateKey) -> bytes:
    return _raw_public(key)


def _dh(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as e:  # low-order point -> all-zero shared secret
        raise HandshakeError(f"invalid X25519 public key from remote: {e}") from None


def hkdf(chaining_key: bytes, input_key_material: bytes, outputs: int) -> list[bytes]:
    """Noise HKDF: HMAC-SHA256 extract, then 2 or 3 chained expand blocks."""
    temp_key = hmac.digest(chaining_key, input_key_material, "sha256")
    out: list[bytes] = []
    previous = b""
    for i in range(1, outputs + 1):
        previous = hmac.digest(temp_key, previous + bytes((i,)), "sha256")
        out.append(previous)
    return out


class CipherState:
    """An AEAD key with its nonce counter; one per direction after the handshake.

    The AEAD object is created once per key (creating it per frame costs more than the
    encryption of a small frame).
    """

    __slots__ = ("aead", "n", "_nonce")

    def __init__(self, key: bytes | None = None, cipher: NoiseCipher = CHACHAPOLY) -> None:
        self.aead: ChaCha20Poly1305 | AESGCM | None = cipher.aead(key) if key is not None else None
        self.n = 0
        self._nonce = cipher.nonce

    def has_key(self) -> bool:
        return self.aead is not None

    def next_nonce(self) -> bytes:
        if self.n >= MAX_NONCE:
            raise HandshakeError("Noise nonce space exhausted; the session must be re-established")
        nonce = self._nonce.pack(self.n)
        self.n += 1
        return nonce

    def encrypt_with_ad(self, ad: bytes | None, plaintext: bytes) -> bytes:
        if self.aead is None:
            return bytes(plaintext)
        return self.aead.encrypt(self.next_nonce(), plaintext, ad)

    def decrypt_with_ad(self, ad: bytes | None, ciphertext: bytes) -> bytes:
        if self.aead is None:
            return bytes(ciphertext)
        if len(ciphertext) < TAGLEN:
            raise HandshakeError(
                f"Noise ciphertext of {len(ciphertext)} bytes is shorter than a tag"
            )
        nonce = self._nonce.pack(self.n)
        try:
            plaintext = self.aead.decrypt(nonce, ciphertext, ad)
        except InvalidTag:
            raise HandshakeError(
                "Noise message failed authentication (tampered or wrong key)"
            ) from None
        self.n += 1  # only advance on success, as the spec requires
        return plaintext


class SymmetricState:
    __slots__ = ("ck", "h", "cipher", "suite")

    def __init__(self, suite: NoiseCipher = CHACHAPOLY) -> None:
        self.suite = suite
        protocol_name = suite.protocol_name
        if len(protocol_name) <= HASHLEN:
            self.h = protocol_name.ljust(HASHLEN, b"\0")
        else:
            self.h = hashlib.sha256(protocol_name).digest()
        self.ck = self.h
        self.cipher = CipherState(cipher=suite)

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key(self, input_key_material: bytes) -> None:
        self.ck, temp_k = hkdf(self.ck, input_key_material, 2)
        self.cipher = CipherState(temp_k[:32], self.suite)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ciphertext = self.cipher.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        plaintext = self.cipher.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[CipherState, CipherState]:
        k1, k2 = hkdf(self.ck, b"", 2)
        return CipherState(k1[:32], self.suite), CipherState(k2[:32], self.suite)


class XXHandshakeState:
    """Runs the three XX messages; ``write_message``/``read_message`` alternate by role.

    After the third message ``split()`` returns ``(send, receive)`` cipher states for this
    side. ``remote_static`` is available once the remote's ``s`` token was processed.
    ``cipher`` picks the cipher function (both sides must use the same one).
    """

    def __init__(
        self,
        initiator: bool,
        static_key: X25519PrivateKey,
        prologue: bytes = b"",
        ephemeral_key: X25519PrivateKey | None = None,
        cipher: NoiseCipher = CHACHAPOLY,
    ) -> None:
        self.initiator = initiator
        self.cipher = cipher
        self.symmetric = SymmetricState(cipher)
        self.symmetric.mix_hash(prologue)
        self.s = static_key
        self.s_pub = _raw_public(static_key)
        self.e = ephemeral_key  # injectable for test vectors; generated lazily otherwise
        self.re: bytes | None = None
        self.rs: bytes | None = None
        self.message_index = 0

    @property
    def remote_static(self) -> bytes | None:
        return self.rs

    @property
    def handshake_hash(self) -> bytes:
        return self.symmetric.h

    @property
    def finished(self) -> bool:
        return self.message_index == len(_XX_PATTERN)

    def _our_turn(self) -> bool:
        return (self.message_index % 2 == 0) == self.initiator

    def _dh_for(self, token: str) -> bytes:
        # "ee": both ephemerals. "es": initiator's e with responder's s. "se": the reverse.
        if token == "ee":
            return _dh(self.e, self.re)  # type: ignore[arg-type]
        if token == "es":
            return _dh(self.e, self.rs) if self.initiator else _dh(self.s, self.re)  # type: ignore[arg-type]
        if token == "se":
            return _dh(self.s, self.re) if self.initiator else _dh(self.e, self.rs)  # type: ignore[arg-type]
        raise AssertionError(token)

    def write_message(self, payload: bytes) -> bytes:
        if self.finished or not self._our_turn():
            raise HandshakeError("Noise handshake message written out of turn")
        out = bytearray()
        for token in _XX_PATTERN[self.message_index]:
            if token == "e":
                if self.e is None:
                    self.e = X25519PrivateKey.generate()
                e_pub = _raw_public(self.e)
                out += e_pub
                self.symmetric.mix_hash(e_pub)
            elif token == "s":
                out += self.symmetric.encrypt_and_hash(self.s_pub)
            else:
                self.symmetric.mix_key(self._dh_for(token))
        out += self.symmetric.encrypt_and_hash(payload)
        self.message_index += 1
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        if self.finished or self._our_turn():
            raise HandshakeError("Noise handshake message received out of turn")
        pos = 0
        for token in _XX_PATTERN[self.message_index]:
            if token == "e":
                if len(message) - pos < DHLEN:
                    raise HandshakeError("Noise handshake message too short for an ephemeral key")
                self.re = bytes(message[pos : pos + DHLEN])
                pos += DHLEN
                self.symmetric.mix_hash(self.re)
            elif token == "s":
                size = DHLEN + (TAGLEN if self.symmetric.cipher.has_key() else 0)
                if len(message) - pos < size:
                    raise HandshakeError("Noise handshake message too short for a static key")
                self.rs = self.symmetric.decrypt_and_hash(bytes(message[pos : pos + size]))
                pos += size
            else:
                self.symmetric.mix_key(self._dh_for(token))
        payload = self.symmetric.decrypt_and_hash(bytes(message[pos:]))
        self.message_index += 1
        return payload

    def split(self) -> tuple[CipherState, CipherState]:
        """``(send, receive)`` cipher states for this side."""
        if not self.finished:
            raise HandshakeError("Noise handshake is not finished")
        c1, c2 = self.symmetric.split()
        return (c1, c2) if self.initiator else (c2, c1)
