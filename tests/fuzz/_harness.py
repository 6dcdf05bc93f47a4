"""The fuzzing harness shared by ``tests/fuzz`` and ``benchmarks/fuzz_decoders.py``.

A :class:`Target` is one decoder under test: ``check(data)`` feeds it untrusted bytes and
asserts its contract (it returns a valid value, or raises the error types its module
documents; anything else, or a hang, is a bug), ``seeds()`` gives valid encodings made by the
real encoders (written to ``corpus/<target>/`` by ``make_corpus.py``) and ``valid()`` more of
them, generated. Hypothesis mixes raw bytes with mutations of valid encodings, so the
fuzzer gets past the first length and type checks of every decoder.

Bounded time: every target runs ``DEFAULT_EXAMPLES`` examples in CI (the whole directory takes
well under a minute on two cores). Locally, ``MOSHPIT_FUZZ_EXAMPLES=N`` runs N examples per
target and ``MOSHPIT_FUZZ_SECONDS=S`` keeps every target going for S seconds. No example
database is written (``database=None``); seeds stay random, so every run explores anew.
"""

from __future__ import annotations

import copy
import math
import os
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgpack
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"
DEFAULT_EXAMPLES = 60
# Per example: far above what any decoder needs for these input sizes (milliseconds), so a
# loaded CI box never trips it, while a quadratic blow-up or a near-hang still does.
DEADLINE_SECONDS = float(os.environ.get("MOSHPIT_FUZZ_DEADLINE", "5"))
ASYNC_LIMIT_SECONDS = 10.0  # an async target still running after this is hung: a bug

CheckFn = Callable[[bytes], None]


@dataclass(frozen=True)
class Target:
    """One decoder under fuzzing (see the module docstring)."""

    name: str
    area: str  # p2p, dht, moshpit, codecs: which test module runs it
    check: CheckFn
    seeds: Callable[[], dict[str, bytes]]
    valid: Callable[[], st.SearchStrategy[bytes]] | None = None
    max_size: int = 256  # of the raw random inputs


TARGETS: dict[str, Target] = {}


def register(target: Target) -> Target:
    if target.name in TARGETS:
        raise ValueError(f"fuzz target {target.name!r} registered twice")
    TARGETS[target.name] = target
    return target


def load_all() -> dict[str, Target]:
    """Import every target module (each registers its targets) and return the registry."""
    from . import targets_codecs, targets_dht, targets_moshpit, targets_p2p  # noqa: F401

    return TARGETS


def names(area: str) -> list[str]:
    return sorted(name for name, t in load_all().items() if t.area == area)


# ---------------------------------------------------------------------------------------------
# corpus


def corpus_files(name: str) -> Iterator[tuple[Path, bytes]]:
    """The committed corpus of a target: ``(path, bytes)`` in a stable order."""
    folder = CORPUS_DIR / name
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.suffix == ".bin":
                yield path, path.read_bytes()


# ---------------------------------------------------------------------------------------------
# strategies

# Bytes that mean something to the decoders here: varint continuation, msgpack type bytes
# (nil, false, bin8, map/array headers, fixext), protobuf keys, 0/max.
_INTERESTING = (
    0x00,
    0x01,
    0x02,
    0x0A,
    0x12,
    0x7F,
    0x80,
    0x81,
    0x90,
    0xC0,
    0xC2,
    0xC4,
    0xCC,
    0xCF,
    0xD4,
    0xDC,
    0xDE,
    0xFF,
)
_WORDS = (
    b"\xff\xff\xff\xff",
    b"\x7f\xff\xff\xff",
    b"\x00\x00\x00\x00",
    b"\x80\x00\x00\x00",
    b"\xff" * 9,
    b"\x80" * 10,
    b"\x00\x10",
    b"\xff\xff",
)


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[bytes], max_mutations: int = 4) -> bytes:
    """``base`` with a few byte-level mutations (none at all, sometimes: a valid input)."""
    data = bytearray(draw(base))
    for _ in range(draw(st.integers(0, max_mutations))):
        n = len(data)
        op = draw(st.integers(0, 9))
        pos = draw(st.integers(0, max(n - 1, 0)))
        if op == 0 and n:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == 1 and n:
            data[pos] = draw(st.sampled_from(_INTERESTING))
        elif op == 2:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == 3 and n:
            del data[pos : pos + draw(st.integers(1, 16))]
        elif op == 4 and n:
            del data[pos:]
        elif op == 5 and n:
            data[pos:pos] = data[pos : pos + draw(st.integers(1, 32))]
        elif op == 6 and n:
            data[pos] = (data[pos] + draw(st.integers(-3, 3))) & 0xFF
        elif op == 7 and n:
            word = draw(st.sampled_from(_WORDS))
            data[pos : pos + len(word)] = word
        elif op == 8 and n:
            data[pos : pos + 2] = b""  # drop a length byte pair
        elif op == 9:
            # msgpack: wrap what follows in nested one-element arrays (deep nesting)
            data[pos:pos] = b"\x91" * draw(st.sampled_from([1, 3, 600, 1100]))
    return bytes(data)


def inputs(target: Target) -> st.SearchStrategy[bytes]:
    """Raw bytes, mutated corpus files and mutated fresh valid encodings."""
    corpus = [data for _, data in corpus_files(target.name)] or list(target.seeds().values())
    parts: list[st.SearchStrategy[bytes]] = [st.binary(max_size=target.max_size)]
    if corpus:
        parts.append(mutated(st.sampled_from(corpus)))
    if target.valid is not None:
        parts.append(mutated(target.valid()))
    return st.one_of(*parts)


def fuzz_settings(max_examples: int | None = None) -> settings:
    env = os.environ.get("MOSHPIT_FUZZ_EXAMPLES")
    count = max_examples if max_examples is not None else int(env or DEFAULT_EXAMPLES)
    return settings(
        max_examples=count,
        deadline=timedelta(seconds=DEADLINE_SECONDS),
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


def regressions(name: str) -> list[tuple[Path, bytes]]:
    """The crashes fuzzing found, kept as ``corpus/<target>/crash-*.bin``."""
    return [(path, data) for path, data in corpus_files(name) if path.name.startswith("crash-")]


def make_test(target: Target, max_examples: int | None = None) -> Callable[[], None]:
    """The hypothesis test of ``target``: every crash found so far as an @example, then
    generated inputs."""

    def fuzz_one(data: bytes) -> None:
        target.check(data)

    test = given(data=inputs(target))(fuzz_one)
    for _, crash in regressions(target.name):
        test = example(data=crash)(test)
    return fuzz_settings(max_examples)(test)


def replay_corpus(target: Target) -> int:
    """Run ``target``'s check on every corpus file; returns how many there are."""
    files = list(corpus_files(target.name))
    assert files, f"no corpus for {target.name}: run python -m tests.fuzz.make_corpus"
    for path, data in files:
        try:
            target.check(data)
        except Exception as e:
            raise AssertionError(f"corpus file {path.relative_to(CORPUS_DIR)} fails") from e
    return len(files)


@dataclass
class RunStats:
    target: str
    seconds: float
    executions: int
    failures: int
    first_failure: str | None = None
    # distinct failures: "ExceptionType at file:line" -> the falsifying input hypothesis shrank
    found: dict[str, str] = field(default_factory=dict)


def _signature(error: BaseException) -> str:
    """Where an error was raised: its type and the innermost frame outside the harness."""
    where = "?"
    tb = error.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if "site-packages" not in filename and not filename.endswith("_harness.py"):
            where = f"{Path(filename).name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return f"{type(error).__name__} at {where}"


def _falsifying(error: BaseException) -> str:
    notes = [n for n in getattr(error, "__notes__", []) if "data=" in n]
    return notes[0].strip() if notes else str(error)[:300]


def run_for(target: Target, seconds: float, batch: int = 200) -> RunStats:
    """Run ``target`` in hypothesis batches until ``seconds`` have passed; count executions and
    failing batches (each failing batch is one shrunk failure)."""
    stats = RunStats(target.name, 0.0, 0, 0)

    def counted(data: bytes) -> None:
        stats.executions += 1
        target.check(data)

    counting = Target(
        target.name, target.area, counted, target.seeds, target.valid, target.max_size
    )
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            make_test(counting, max_examples=batch)()
        except Exception as e:  # noqa: BLE001 - a failing batch is what we count
            stats.failures += 1
            if stats.first_failure is None:
                stats.first_failure = traceback.format_exc()
            errors = getattr(e, "exceptions", None) or (e,)  # several bugs: an ExceptionGroup
            for error in errors:
                stats.found.setdefault(_signature(error), _falsifying(error))
    stats.seconds = time.monotonic() - start
    return stats


def run_target(target: Target) -> None:
    """What the pytest test of a target runs: examples, or a time budget if one is set."""
    seconds = float(os.environ.get("MOSHPIT_FUZZ_SECONDS", "0") or 0)
    if seconds > 0:
        stats = run_for(target, seconds)
        assert stats.failures == 0, stats.first_failure
    else:
        make_test(target)()


# ---------------------------------------------------------------------------------------------
# helpers for the checks

_CHUNKS = (1, 2, 3, 5, 8, 13, 64, 4096)


def split_control(data: bytes) -> tuple[int, int, bytes]:
    """A stream target's input: first byte = (mode << 3) | read-size index, then the bytes
    the remote sends. Returns ``(mode, read_size, payload)``."""
    if not data:
        return 0, 4096, b""
    return data[0] >> 3, _CHUNKS[data[0] & 7], data[1:]


def control(mode: int, chunk_index: int = 7) -> bytes:
    """The control byte of :func:`split_control` (for seeds)."""
    return bytes(((mode << 3) | chunk_index,))


def run_trio(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run an async check under a hard limit: still running after it is a hang (a bug)."""

    async def main() -> Any:
        with trio.fail_after(ASYNC_LIMIT_SECONDS):
            return await fn(*args)

    return trio.run(main)


class ScriptedStream(trio.abc.HalfCloseableStream):
    """A remote peer that sends ``data`` in reads of at most ``chunk`` bytes, then EOF (or,
    with ``hold_open``, nothing more). What we send is kept in ``sent``."""

    def __init__(self, data: bytes, chunk: int = 4096, *, hold_open: bool = False) -> None:
        self._data = memoryview(bytes(data))
        self._chunk = max(1, chunk)
        self._hold_open = hold_open
        self.sent = bytearray()
        self.eof_sent = False
        self.closed = False

    @property
    def remaining(self) -> int:
        return len(self._data)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        if self.closed:
            raise trio.ClosedResourceError("closed")
        if not self._data:
            if self._hold_open:
                await trio.sleep_forever()
            return b""
        n = self._chunk if max_bytes is None else min(self._chunk, max_bytes)
        out = bytes(self._data[:n])
        self._data = self._data[n:]
        return out

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await trio.lowlevel.checkpoint()
        if self.closed or self.eof_sent:
            raise trio.ClosedResourceError("closed")
        self.sent += data

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        self.eof_sent = True

    async def aclose(self) -> None:
        self.closed = True
        await trio.lowlevel.checkpoint()


def same(a: Any, b: Any) -> bool:
    """Equality that treats NaN as equal to NaN (decoded msgpack floats may be NaN)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):  # item by item: keys may be NaN too
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------------------------------------
# msgpack messages: most protocols here are msgpack maps, so besides byte-level mutations the
# fuzzer also edits their *structure* (a field replaced, dropped or added)

MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=4) | st.integers(0, 9), children, max_size=4)
    ),
    max_leaves=12,
)
# values at the edges of what the parsers check: bounds of int types, non-finite floats, empty
# and oversized containers
EDGE_VALUES = st.sampled_from(
    [
        None,
        True,
        False,
        0,
        -1,
        1,
        2,
        2**31 - 1,
        2**31,
        2**32,
        2**53,
        2**63 - 1,
        -(2**63),
        2**64 - 1,
        0.0,
        -0.0,
        0.5,
        1e308,
        -1e308,
        math.nan,
        math.inf,
        -math.inf,
        5e-324,
        "",
        "x" * 300,
        "ls",
        b"",
        bytes(32),
        b"\xff" * 65,
        [],
        {},
        [[]],
        {"": None},
        [0] * 40,
    ]
)


def body(obj: Any) -> bytes:
    """The msgpack body of one message, as every protocol here packs it."""
    return msgpack.packb(obj, use_bin_type=True)


def wire(obj: Any) -> Any:
    """``obj`` as a receiver decodes it (bytes for memoryviews, lists for tuples)."""
    return msgpack.unpackb(body(obj), raw=False, strict_map_key=False)


def _slots(obj: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) inside ``obj``, depth first."""
    out: list[tuple[Any, Any]] = []
    stack = [obj]
    while stack:
        container = stack.pop()
        keys = list(container) if isinstance(container, dict) else range(len(container))
        for key in keys:
            out.append((container, key))
            if isinstance(container[key], (dict, list)):
                stack.append(container[key])
    return out


@st.composite
def tweaked(draw: st.DrawFn, base: st.SearchStrategy[Any], max_tweaks: int = 3) -> bytes:
    """The msgpack body of ``base`` (a decoded message) with a few fields replaced by edge
    values or random ones, dropped, or with an extra field or item added."""
    obj = copy.deepcopy(wire(draw(base)))
    values = EDGE_VALUES | MSGPACK_VALUES
    for _ in range(draw(st.integers(0, max_tweaks))):
        slots = _slots(obj) if isinstance(obj, (dict, list)) else []
        if not slots:
            break
        container, key = draw(st.sampled_from(slots))
        op = draw(st.integers(0, 4))
        # drawn values are copied: sampled ones are shared, and later tweaks edit in place
        if op <= 1:
            container[key] = copy.deepcopy(draw(values))
        elif op == 2:
            del container[key]
        elif op == 4 and isinstance(container, dict):
            # the same field under a near-miss key: a trailing newline, bytes, another type
            near = [key + "\n", key.encode()] if isinstance(key, str) else [str(key)]
            new_key = draw(st.sampled_from(near) | st.text(max_size=4) | st.integers(-1, 3))
            container[new_key] = container.pop(key)
        elif isinstance(container, dict):
            container[draw(st.text(max_size=6))] = copy.deepcopy(draw(values))
        else:
            container.insert(key, copy.deepcopy(draw(values)))
    return body(obj)
