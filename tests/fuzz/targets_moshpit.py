"""Fuzz targets of moshpit's messages: all-reduce, matchmaking, group keys, state manifests,
state sharing (records, requests, ``have`` answers), progress records and ``moshpit status``.

Every input is what a peer can send (a msgpack body, a raw stream, or a value read from the
DHT); the checks hold each parser to the error types its caller handles.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import strategies as st

from dht.kademlia.records import ValueWithExpiration
from dht.p2p.errors import (
    IdentityError,
    MessageTooLargeError,
    ProtocolViolationError,
    StreamClosedError,
)
from dht.p2p.identity import PeerID
from dht.p2p.messages import MessageReader, send_msg, unpack_body
from dht.p2p.varint import encode_uvarint
from moshpit.averaging.allreduce_protocol import (
    MAX_WEIGHT,
    ProtocolError,
    RemoteAbort,
    chunk_msg,
    decode_chunk,
    decode_chunk_into,
    error_msg,
    hello_msg,
    max_chunk_message,
    parse_chunk,
    parse_hello,
    parse_result,
    raw_float32_destination,
    receive_with_payload,
    result_msg,
    split_payload,
)
from moshpit.averaging.group_info import MODES, GroupInfo, GroupInfoError
from moshpit.averaging.group_keys import make_group_key, parse_group_key
from moshpit.averaging.matchmaking import JoinRequest, Matchmaker, MatchmakingError
from moshpit.cli.status_cmd import parse_donor_records
from moshpit.training.errors import ManifestError
from moshpit.training.manifest import DIGEST_BYTES, Manifest, build_manifest
from moshpit.training.progress import aggregate, owner_subkey, parse_progress_records
from moshpit.training.sharing import MAX_RECORD_NUMBER, StateSharing
from moshpit.training.sharing_download import Download as _Download
from moshpit.training.sharing_plan import Holder as _Holder
from moshpit.training.sharing_protocol import BadRequest as _BadRequest
from moshpit.training.sharing_protocol import ServedState as _Served
from moshpit.training.sharing_protocol import parse_record as _parse_record
from moshpit.training.sharing_streams import StateService as _StateService

from ._harness import (
    ScriptedStream,
    Target,
    body,
    control,
    register,
    run_trio,
    same,
    split_control,
    tweaked,
    wire,
)
from .targets_codecs import codecs
from .targets_p2p import ALICE, BOB, PEERS, SEED_ADDRS, _raw, _text

NUMEL = 24  # elements of the chunk every all-reduce check expects
MEMBERS = 4
NOW = 1_700_000_000.0


def _chunks() -> list[Any]:
    """Compressed chunks of ``NUMEL`` values, one per codec configuration."""
    values = torch.linspace(-3, 3, NUMEL)
    # bytes payloads: a memoryview (what compress gives) cannot sit in a hypothesis strategy
    chunks = [codec.compress(values) for codec in codecs()]
    return [dataclasses.replace(ct, payload=bytes(ct.payload)) for ct in chunks]


# ---------------------------------------------------------------------------------------------
# all-reduce


def _check_decoded(ct: Any) -> None:
    """A parsed chunk decodes to NUMEL finite float32 values or is refused with ProtocolError."""
    try:
        values = decode_chunk(ct, NUMEL)
    except ProtocolError:
        values = None
    else:
        assert values.dtype == torch.float32 and values.shape == (NUMEL,)
        assert bool(torch.isfinite(values).all())
    target = torch.empty(NUMEL)
    try:
        decode_chunk_into(ct, target)
    except ProtocolError:
        return
    assert bool(torch.isfinite(target).all())
    if values is not None:
        assert torch.equal(values, target)


def check_allreduce_hello(data: bytes) -> None:
    try:
        hello = parse_hello(unpack_body(data))
    except (ProtocolViolationError, ProtocolError, RemoteAbort):
        return
    assert 0 < len(hello.group_id) <= 64 and 0 <= hello.part <= 1 << 16 and 1 <= hello.chunk
    assert 0 <= hello.weight <= MAX_WEIGHT and math.isfinite(hello.weight)
    again = hello_msg(hello.group_id, hello.part, hello.total, hello.chunk, hello.weight)
    assert parse_hello(unpack_body(body(again))) == hello


HELLO = hello_msg(b"g" * 16, 1, 3 * NUMEL, NUMEL, 2.5)
register(
    Target(
        "allreduce_hello",
        "moshpit",
        check_allreduce_hello,
        seeds=lambda: {"hello": body(HELLO), "error": body(error_msg("busy", left_out=True))},
        valid=lambda: tweaked(st.just(HELLO)),
    )
)


def _chunk_bodies() -> dict[str, bytes]:
    return {f"{i}-{ct.codec_id}": body(chunk_msg(0, ct)) for i, ct in enumerate(_chunks())}


def check_allreduce_chunk(data: bytes) -> None:
    try:
        ct = parse_chunk(unpack_body(data), 0, NUMEL)
    except (ProtocolViolationError, ProtocolError, RemoteAbort):
        return
    assert ct.numel == NUMEL
    _check_decoded(ct)


register(
    Target(
        "allreduce_chunk",
        "moshpit",
        check_allreduce_chunk,
        seeds=_chunk_bodies,
        valid=lambda: tweaked(st.sampled_from(_chunks()).map(lambda ct: chunk_msg(0, ct))),
    )
)


def _results() -> list[dict[str, Any]]:
    chunks = _chunks()
    return [
        result_msg(0, chunks[0], 0.1, 2),
        result_msg(0, chunks[4], 0.0, 3, missing=(1, 2)),
        result_msg(0, None, 0.0, 0),
    ]


def check_allreduce_result(data: bytes) -> None:
    try:
        result = parse_result(unpack_body(data), 0, NUMEL, members=MEMBERS)
    except (ProtocolViolationError, ProtocolError, RemoteAbort):
        return
    assert (result.ct is None) == (result.contributors == 0)
    assert len(set(result.missing)) == len(result.missing)
    assert all(0 <= i < MEMBERS for i in result.missing)
    if result.ct is not None:
        _check_decoded(result.ct)


register(
    Target(
        "allreduce_result",
        "moshpit",
        check_allreduce_result,
        seeds=lambda: {f"result{i}": body(msg) for i, msg in enumerate(_results())},
        valid=lambda: tweaked(st.sampled_from(_results())),
    )
)


class _MsgStream:
    """The part of P2PStream that all-reduce reads with, over a scripted remote."""

    def __init__(self, remote: ScriptedStream) -> None:
        self._reader = MessageReader(remote)

    async def receive_msg(self, max_size: int | None = None) -> Any:
        return await self._reader.receive_msg(max_size or 1 << 20)

    async def receive_exactly_into(self, buffer: memoryview) -> None:
        await self._reader.receive_exactly_into(buffer)


async def _allreduce_stream(data: bytes) -> None:
    mode, chunk, payload = split_control(data)
    stream = _MsgStream(ScriptedStream(payload, chunk))
    target = torch.empty(NUMEL)
    destination = raw_float32_destination(NUMEL, target if mode & 1 else None)
    for _ in range(4):
        try:
            msg = await receive_with_payload(stream, max_chunk_message(NUMEL), destination)
            kind = msg.get("t") if isinstance(msg, dict) else None
            if kind == "result":
                result = parse_result(msg, 0, NUMEL, members=MEMBERS)
                ct = result.ct
            elif kind == "hello":
                parse_hello(msg)
                continue
            else:
                ct = parse_chunk(msg, 0, NUMEL)
        except (ProtocolViolationError, MessageTooLargeError, StreamClosedError):
            return
        except (ProtocolError, RemoteAbort):
            continue
        if ct is not None:
            try:
                decode_chunk_into(ct, target)  # in place when the payload went into target
            except ProtocolError:
                continue
            assert bool(torch.isfinite(target).all())


def check_allreduce_stream(data: bytes) -> None:
    run_trio(_allreduce_stream, data)


def _wire_form(msg: dict[str, Any]) -> bytes:
    header, payload = split_payload(msg)
    return body_framed(header) + bytes(payload)


def body_framed(msg: Any) -> bytes:
    raw = body(msg)
    return encode_uvarint(len(raw)) + raw


def _stream_seeds() -> dict[str, bytes]:
    chunks = _chunks()
    seeds = {
        f"chunk{i}": control(i % 2, 7 - i % 3) + body_framed(HELLO) + _wire_form(chunk_msg(0, ct))
        for i, ct in enumerate(chunks)
    }
    seeds["result-raw"] = control(1) + _wire_form(result_msg(0, chunks[0], 0.5, 2))
    seeds["error"] = control(0) + body_framed(error_msg("stalled", left_out=True))
    return seeds


register(
    Target(
        "allreduce_stream",
        "moshpit",
        check_allreduce_stream,
        seeds=_stream_seeds,
        valid=lambda: st.builds(
            lambda c, ct, k: (
                control(c >> 3, c & 7)
                + _wire_form(chunk_msg(k, ct) if k >= 0 else result_msg(0, ct, 1.0, 1))
            ),
            st.integers(0, 15),
            st.sampled_from(_chunks()),
            st.integers(-1, 1),
        ),
        max_size=512,
    )
)

# ---------------------------------------------------------------------------------------------
# matchmaking and group keys


def _group(gathered: bool = True) -> GroupInfo:
    return GroupInfo(
        group_id=b"group-0001",
        members=tuple(PEERS),
        modes=("node", "client", "aux"),
        bandwidths=(1e8, None, 5e6),
        gathered=({"epoch": 3}, None, [1, 2]) if gathered else (),
        addrs=tuple((str(a),) for a in SEED_ADDRS[:3]),
        bytes_per_value=(4.0, None, 2.0),
        measured_uplinks=(None, 2.5e4, None),
    )


def check_group_info(data: bytes) -> None:
    try:
        group = GroupInfo.from_msg(unpack_body(data))
    except (ProtocolViolationError, GroupInfoError):
        return
    assert all(mode in MODES for mode in group.modes)
    assert same(wire(group.to_msg()), wire(GroupInfo.from_msg(wire(group.to_msg())).to_msg()))
    group.reducer_indices, group.sender_indices  # noqa: B018 - must not raise


register(
    Target(
        "group_info",
        "moshpit",
        check_group_info,
        seeds=lambda: {"group": body(_group().to_msg()), "bare": body(_group(False).to_msg())},
        valid=lambda: tweaked(st.builds(lambda g: g.to_msg(), st.sampled_from([_group()]))),
    )
)

JOIN = JoinRequest(
    key="run.0b01",
    order=12.5,
    seconds_left=3.0,
    mode="node",
    bandwidth=1e8,
    gathered={"epoch": 1},
    size=2,
    addrs=(str(SEED_ADDRS[0]),),
    schema=b"s" * 16,
    bytes_per_value=4.0,
    measured_uplink=2.5e4,
)


def check_matchmaking_join(data: bytes) -> None:
    try:
        msg = unpack_body(data)
    except ProtocolViolationError:
        return
    if not isinstance(msg, Mapping) or not isinstance(msg.get("prefix"), str):
        return  # the dispatcher answers these itself (see MatchmakingDispatcher)
    try:
        request = JoinRequest.from_msg(msg)
    except MatchmakingError:
        return
    assert request.mode in MODES and 1 <= request.size
    again = JoinRequest.from_msg(wire(request.to_msg(msg["prefix"])))
    assert same(wire(again.to_msg("p")), wire(request.to_msg("p")))


register(
    Target(
        "matchmaking_join",
        "moshpit",
        check_matchmaking_join,
        seeds=lambda: {"join": body(JOIN.to_msg("run"))},
        valid=lambda: tweaked(st.just(JOIN.to_msg("run"))),
    )
)


class _Backend:
    """Just what Matchmaker._parse_reply uses of the DHT backend."""

    local_peer = ALICE.peer_id

    def register(self, prefix: str, handler: Any) -> None:
        pass

    def peer_from_bytes(self, data: bytes) -> PeerID:
        return PeerID.from_bytes(data)

    def decode_group(self, msg: Any) -> GroupInfo:
        return GroupInfo.from_msg(msg)


MATCHMAKER = Matchmaker(_Backend(), "run", target_group_size=4)  # type: ignore[arg-type]


def check_matchmaking_reply(data: bytes) -> None:
    try:
        reply = unpack_body(data)
    except ProtocolViolationError:
        return
    for accepted_ok in (True, False):
        try:
            kind, detail = MATCHMAKER._parse_reply(reply, accepted_ok)
        except (MatchmakingError, GroupInfoError):
            continue
        assert kind in ("accepted", "reject", "redirect", "group")
        if kind == "group":
            assert detail.index_of(ALICE.peer_id) >= 0


def _replies() -> dict[str, dict[str, Any]]:
    return {
        "accepted": {"t": "accepted"},
        "reject": {"t": "reject", "why": "busy: asking another leader, retry shortly"},
        "redirect": {"t": "redirect", "to": BOB.peer_id.to_bytes(), "a": [str(SEED_ADDRS[0])]},
        "group": {"t": "group", "group": _group().to_msg()},
    }


register(
    Target(
        "matchmaking_reply",
        "moshpit",
        check_matchmaking_reply,
        seeds=lambda: {name: body(msg) for name, msg in _replies().items()},
        valid=lambda: tweaked(st.sampled_from(list(_replies().values()))),
    )
)


def check_group_key(data: bytes) -> None:
    key = _text(data)
    try:
        prefix, bits = parse_group_key(key)
    except ValueError:
        return
    assert prefix and all(b in "01" for b in bits), (prefix, bits)
    assert make_group_key(prefix, bits) == key


register(
    Target(
        "group_key",
        "moshpit",
        check_group_key,
        seeds=lambda: {"key": b"run.0b0110", "no-bits": b"run.0b", "dotted": b"a.0b1.0b01"},
        valid=lambda: st.builds(
            lambda p, b: _raw(make_group_key(p, b)),
            st.text(min_size=1, max_size=12),
            st.text("01", max_size=12),
        ),
        max_size=40,
    )
)

# ---------------------------------------------------------------------------------------------
# state: manifests, records, requests


def _manifest() -> tuple[Manifest, dict[bytes, memoryview]]:
    tensors = [
        ("w", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
        ("b", torch.zeros(0)),
        ("step", torch.tensor(7, dtype=torch.int64)),
        ("mask", torch.tensor([True, False])),
    ]
    return build_manifest(tensors, epoch=5, metadata={"lr": 0.1, "tags": ["a"]}, chunk_bytes=16)


def check_manifest(data: bytes) -> None:
    try:
        manifest = Manifest.from_bytes(data)
    except ManifestError:
        return
    assert manifest.to_bytes() == data and manifest.root == hashlib.sha256(data).digest()
    manifest.check_fits(manifest.schema())
    for spec in manifest.tensors:
        assert sum(c.size for c in spec.chunks) == spec.nbytes
        assert all(len(c.digest) == DIGEST_BYTES for c in spec.chunks)


register(
    Target(
        "manifest",
        "moshpit",
        check_manifest,
        seeds=lambda: {"state": _manifest()[0].to_bytes()},
        valid=lambda: tweaked(
            st.just(_manifest()[0]).map(lambda m: unpack_body(m.to_bytes())), max_tweaks=2
        ),
        max_size=400,
    )
)


def _found(data: bytes) -> Any:
    """A DHT value as ``node.get`` returns it: a dict value's entries carry expirations."""
    try:
        value = unpack_body(data)
    except ProtocolViolationError:
        return None
    if isinstance(value, dict):
        value = {k: ValueWithExpiration(v, NOW + 30) for k, v in value.items()}
    return ValueWithExpiration(value, NOW + 30)


PROGRESS = {
    owner_subkey(ALICE.peer_id): {
        "epoch": 3,
        "samples": 120,
        "sps": 40.0,
        "time": NOW - 2,
        "ok": True,
        "loss": 0.25,
    },
    owner_subkey(BOB.peer_id): {
        "epoch": 3,
        "samples": 80,
        "sps": 35.5,
        "time": NOW - 1,
        "ok": False,
        "ckf": 2,
    },
    "unsigned": {"epoch": 9},
}


def check_progress_records(data: bytes) -> None:
    found = _found(data)
    peers, ignored = parse_progress_records(found, now=NOW, max_clock_skew=30, max_lifetime=600)
    for peer in peers:
        assert 0 <= peer.epoch < 2**53 and 0 <= peer.samples < 2**53
        assert math.isfinite(peer.samples_per_second) and math.isfinite(peer.time)
    view = aggregate(peers, now=NOW, target_batch_size=256, ignored=ignored)
    assert view.num_peers <= len(peers) + 1 and view.epoch >= 0


register(
    Target(
        "progress_records",
        "moshpit",
        check_progress_records,
        seeds=lambda: {"two-peers": body(PROGRESS)},
        valid=lambda: tweaked(st.just(PROGRESS)),
    )
)

MANIFEST_ROOT = hashlib.sha256(b"state").digest()
DONORS = {
    owner_subkey(ALICE.peer_id): {
        "root": MANIFEST_ROOT,
        "epoch": 5,
        "bytes": 4096,
        "complete": True,
        "addrs": [str(SEED_ADDRS[0])],
    },
    owner_subkey(BOB.peer_id): {
        "root": MANIFEST_ROOT,
        "epoch": 5,
        "bytes": 4096,
        "complete": False,
        "addrs": [],
    },
    owner_subkey(PEERS[2]): None,  # withdrawn
}


def check_donor_records(data: bytes) -> None:
    """``moshpit status`` and a joiner read the same ``{prefix}.state`` records."""
    found = _found(data)
    donors, ignored = parse_donor_records(found)
    for donor in donors:
        assert len(bytes.fromhex(donor.root)) == DIGEST_BYTES
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return
    for subkey, entry in value.items():
        try:
            record = _parse_record(subkey, entry.value, PeerID.from_base58)
        except (ValueError, IdentityError):
            continue
        assert subkey == owner_subkey(record.peer)  # one spelling of each donor's subkey
        assert len(record.root) == DIGEST_BYTES
        assert 0 <= record.epoch < MAX_RECORD_NUMBER and 0 <= record.nbytes < MAX_RECORD_NUMBER


register(
    Target(
        "donor_records",
        "moshpit",
        check_donor_records,
        seeds=lambda: {"donors": body(DONORS)},
        valid=lambda: tweaked(st.just(DONORS)),
    )
)


class _Store:
    def __init__(self, chunks: dict[bytes, memoryview]) -> None:
        self.chunks = {d: bytes(c) for d, c in chunks.items()}

    def read_chunk(self, digest: bytes) -> bytes | None:
        return self.chunks.get(digest)


class _ReplyStream:
    remote_peer = BOB.peer_id

    def __init__(self) -> None:
        self.sent: list[Any] = []

    async def send_msg(self, obj: Any) -> None:
        self.sent.append(obj)


def _sharing() -> tuple[StateSharing, _StateService]:
    manifest, chunks = _manifest()
    node = SimpleNamespace(host=SimpleNamespace(), peer_id=ALICE.peer_id)  # serving needs none
    sharing = StateSharing(node, "run", _Store(chunks), batch_bytes=64)
    sharing._published = _Served.of(manifest)
    service = _StateService(request_timeout=5.0)
    service.handlers["run"] = sharing
    return sharing, service


async def _state_request(data: bytes) -> None:
    try:
        request = unpack_body(data)
    except ProtocolViolationError:
        return
    _, service = _sharing()
    stream = _ReplyStream()
    try:
        sharing = service._route(request)
        await sharing._serve(stream, request)
    except _BadRequest:
        return
    (reply,) = stream.sent
    framed = bytearray()

    class _Sink:
        async def send_all(self, part: Any) -> None:
            framed.extend(part)

    await send_msg(_Sink(), reply)  # every answer is a sendable message


def check_state_request(data: bytes) -> None:
    run_trio(_state_request, data)


def _state_requests() -> dict[str, dict[str, Any]]:
    manifest = _manifest()[0]
    digests = list(manifest.chunk_refs())
    return {
        "manifest": {"prefix": "run", "op": "manifest", "root": manifest.root},
        "have": {"prefix": "run", "op": "have", "root": manifest.root},
        "chunks": {"prefix": "run", "op": "chunks", "digests": digests[:3] + [bytes(32)]},
    }


register(
    Target(
        "state_request",
        "moshpit",
        check_state_request,
        seeds=lambda: {name: body(msg) for name, msg in _state_requests().items()},
        valid=lambda: tweaked(st.sampled_from(list(_state_requests().values()))),
    )
)


def check_state_have(data: bytes) -> None:
    """A partial holder's ``have`` answer, as a joiner takes it."""
    try:
        reply = unpack_body(data)
    except ProtocolViolationError:
        return
    if not isinstance(reply, dict):
        return  # the joiner drops non-map replies before looking inside
    manifest = _manifest()[0]
    download = _Download(manifest, _Served.of(manifest))
    holder = _Holder(BOB.peer_id, complete=False)
    StateSharing._update_have(download, holder, reply)
    n = len(download.digests)
    assert holder.have <= set(range(n)) and holder.pending <= set(range(n))


def _have_reply() -> dict[str, bytes]:
    n = len(_manifest()[0].chunk_refs())
    return {"have": bytes([0b101]) + bytes((n + 7) // 8 - 1), "pending": bytes((n + 7) // 8)}


register(
    Target(
        "state_have",
        "moshpit",
        check_state_have,
        seeds=lambda: {"have": body(_have_reply())},
        valid=lambda: tweaked(st.just(_have_reply())),
    )
)
