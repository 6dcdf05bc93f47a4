"""Owner-signed records: valid ones pass; unsigned, forged and tampered ones are rejected."""

from dataclasses import replace

from dht.kademlia.ids import serialize
from dht.kademlia.records import DHTRecord
from dht.kademlia.validation import OwnerSignatureValidator, ValidatorChain, default_validators

from .conftest import Identity


def owner_record(identity, value="v", subkey=None, exp=100.0):
    key = f"run.progress[owner:{identity.peer_id}]"
    return DHTRecord(
        serialize(key), None if subkey is None else serialize(subkey), serialize(value), exp
    )


def test_owner_can_sign_and_others_verify():
    alice = Identity.generate()
    signed = OwnerSignatureValidator(alice).sign(owner_record(alice))
    assert signed.signature is not None
    assert OwnerSignatureValidator().validate(signed) is None


def test_unsigned_forged_and_replayed_records_are_rejected():
    alice, mallory = Identity.generate(), Identity.generate()
    checker = OwnerSignatureValidator()
    assert checker.validate(owner_record(alice)) == "owner record is not signed"
    # mallory signs a record that claims alice as owner
    forged = replace(owner_record(alice), signature=mallory.sign(b"anything"))
    assert checker.validate(forged) == "invalid owner signature"
    # mallory's own validator refuses to sign records owned by alice
    assert OwnerSignatureValidator(mallory).sign(owner_record(alice)).signature is None
    # a genuine record replayed with a changed value or a longer expiration
    genuine = OwnerSignatureValidator(alice).sign(owner_record(alice, value="honest"))
    assert checker.validate(replace(genuine, value=serialize("evil"))) == "invalid owner signature"
    assert checker.validate(replace(genuine, expiration_time=1e9)) == "invalid owner signature"


def test_subkey_owner_and_malformed_markers():
    alice, bob = Identity.generate(), Identity.generate()
    rec = DHTRecord(serialize("group"), serialize(f"[owner:{alice.peer_id}]"), serialize(1), 10.0)
    assert OwnerSignatureValidator().validate(rec) == "owner record is not signed"
    assert OwnerSignatureValidator().validate(OwnerSignatureValidator(alice).sign(rec)) is None
    both = DHTRecord(
        serialize(f"k[owner:{alice.peer_id}]"), serialize(f"[owner:{bob.peer_id}]"), b"\x01", 10.0
    )
    assert "different owners" in OwnerSignatureValidator().validate(both)
    bad = DHTRecord(serialize("k[owner:not-a-peer]"), None, b"\x01", 10.0, signature=b"x" * 64)
    assert OwnerSignatureValidator().validate(bad) == "owner is not a valid PeerID"
    unterminated = DHTRecord(serialize("k[owner:abc"), None, b"\x01", 10.0)
    assert "malformed" in OwnerSignatureValidator().validate(unterminated)


class RejectOddValues:
    """A schema-style validator: only even integers are allowed."""

    def validate(self, record):
        value = record.value
        return None if value and value[0] % 2 == 0 else "odd values are not allowed"

    def sign(self, record):
        return record


def test_validator_chain_is_pluggable():
    chain = default_validators(extra=[RejectOddValues()])
    assert chain.validate(DHTRecord(serialize("k"), None, serialize(2), 1.0)) is None
    assert (
        chain.validate(DHTRecord(serialize("k"), None, serialize(3), 1.0))
        == "odd values are not allowed"
    )

    class Broken:
        def validate(self, record):
            raise RuntimeError("bug")

        def sign(self, record):
            return record

    assert "failed" in ValidatorChain([Broken()]).validate(DHTRecord(b"\x01", None, b"\x01", 1.0))
