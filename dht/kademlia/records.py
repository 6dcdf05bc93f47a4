"""Record types shared by storage, validation, the wire protocol and the public API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

T = TypeVar("T")


class ValueWithExpiration(NamedTuple, Generic[T]):
    """A value and the absolute DHT time at which it expires.

    For a dictionary key, ``value`` is ``dict[subkey, ValueWithExpiration]`` and
    ``expiration_time`` is the latest expiration among its subkeys.
    """

    value: T
    expiration_time: float


@dataclass(frozen=True)
class DHTRecord:
    """One (key, subkey) entry as it travels and is stored: everything already serialized.

    Keeping the msgpack bytes (not decoded objects) means signatures cover exactly what is
    stored and served, and storage never has to re-encode untrusted input.
    """

    key: bytes  # msgpack of the key
    subkey: bytes | None  # msgpack of the subkey, None for a plain value
    value: bytes  # msgpack of the value
    expiration_time: float
    signature: bytes | None = None

    @property
    def size(self) -> int:
        """Bytes this record costs in storage accounting (fixed overhead for the bookkeeping)."""
        return (
            len(self.key)
            + len(self.subkey or b"")
            + len(self.value)
            + len(self.signature or b"")
            + RECORD_OVERHEAD
        )

    def to_wire(self) -> list[Any]:
        return [self.key, self.subkey, self.value, self.expiration_time, self.signature]


RECORD_OVERHEAD = 64
