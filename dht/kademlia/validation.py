"""Record validators: owner signatures and a pluggable chain for further checks (e.g. schemas).

A validator returns ``None`` when a record is acceptable and a short reason string otherwise.
The same chain runs on the storing side (before a replica accepts a record) and on the reading
side (before a value found in the network is returned), because replicas are untrusted too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import msgpack

from dht.kademlia.records import DHTRecord

logger = logging.getLogger(__name__)

OWNER_MARKER = b"[owner:"
_OWNER_RE = re.compile(rb"\[owner:([^\]]{1,128})\]")
SIGNATURE_DOMAIN = b"moshpit-dht-record-v1"


class RecordValidator(Protocol):
    """Checks a record; may also sign records that this node writes itself."""

    def validate(self, record: DHTRecord) -> str | None:
        """Return None if ``record`` may be stored/served, else the reason it is rejected."""
        ...

    def sign(self, record: DHTRecord) -> DHTRecord:
        """Return ``record``, possibly with a signature added (identity for most validators)."""
        ...


def signing_payload(record: DHTRecord) -> bytes:
    """The bytes an owner signs: key, subkey, value and expiration under a domain tag."""
    return msgpack.packb(
        [
            SIGNATURE_DOMAIN,
            record.key,
            record.subkey or b"",
            record.value,
            float(record.expiration_time),
        ],
        use_bin_type=True,
    )


def find_owners(data: bytes | None) -> list[bytes] | None:
    """Owner PeerIDs (base58 bytes) named in ``data``; None if an owner marker is malformed."""
    if not data or OWNER_MARKER not in data:
        return []
    owners = _OWNER_RE.findall(data)
    if len(owners) != data.count(OWNER_MARKER):
        return None
    return owners


def _peer_id_class() -> Any:
    try:
        from dht.p2p import PeerID
    except ImportError:  # the package exports may land after the module itself
        from dht.p2p.identity import PeerID
    return PeerID


class OwnerSignatureValidator:
    """Records whose key or subkey contains ``[owner:<PeerID>]`` need that peer's signature.

    The signature covers key, subkey, value and expiration, so a replayed record with a changed
    value (or a forged expiration) fails verification. ``identity`` (optional) lets this node
    sign the records it owns.
    """

    def __init__(self, identity: Any = None):
        self.identity = identity
        self._own_marker = str(identity.peer_id).encode() if identity is not None else None

    def _owner(self, record: DHTRecord) -> tuple[bytes | None, str | None]:
        owners: set[bytes] = set()
        for part in (record.key, record.subkey):
            found = find_owners(part)
            if found is None:
                return None, "malformed [owner:...] marker"
            owners.update(found)
        if len(owners) > 1:
            return None, "key and subkey name different owners"
        return (owners.pop() if owners else None), None

    def validate(self, record: DHTRecord) -> str | None:
        owner, problem = self._owner(record)
        if problem is not None:
            return problem
        if owner is None:
            return None
        if record.signature is None:
            return "owner record is not signed"
        PeerID = _peer_id_class()

        try:
            peer_id = PeerID.from_base58(owner.decode("ascii"))
        except Exception:  # noqa: BLE001 - any parse failure means "not a valid owner"
            return "owner is not a valid PeerID"
        try:
            valid = peer_id.verify(signing_payload(record), record.signature)
        except Exception:  # noqa: BLE001 - keys that cannot verify are invalid signatures
            valid = False
        return None if valid else "invalid owner signature"

    def sign(self, record: DHTRecord) -> DHTRecord:
        if self.identity is None:
            return record
        owner, problem = self._owner(record)
        if problem is not None or owner is None or owner != self._own_marker:
            return record
        signature = self.identity.sign(signing_payload(record))
        return DHTRecord(record.key, record.subkey, record.value, record.expiration_time, signature)


class ValidatorChain:
    """Runs validators in order; the first reason wins. Signing runs through all of them."""

    def __init__(self, validators: Iterable[RecordValidator] = ()):
        self.validators: list[RecordValidator] = list(validators)

    def add(self, validator: RecordValidator) -> None:
        self.validators.append(validator)

    def validate(self, record: DHTRecord) -> str | None:
        for validator in self.validators:
            try:
                reason = validator.validate(record)
            except Exception as e:  # noqa: BLE001 - a buggy validator must not crash the node
                logger.warning("validator %r failed on a record: %r", validator, e)
                reason = f"validator {type(validator).__name__} failed"
            if reason is not None:
                return reason
        return None

    def sign(self, record: DHTRecord) -> DHTRecord:
        for validator in self.validators:
            record = validator.sign(record)
        return record

    def __iter__(self) -> Iterator[RecordValidator]:
        return iter(self.validators)


def default_validators(
    identity: Any = None, extra: Sequence[RecordValidator] = ()
) -> ValidatorChain:
    return ValidatorChain([OwnerSignatureValidator(identity), *extra])
