"""An in-memory network with the same transport interface as TCP, for simulations and tests.

Every byte is timed with trio's clock, so latency and bandwidth are exact (and a simulation
with many hosts runs fast) under ``trio.testing.MockClock(autojump_threshold=0)``:

* a chunk sent on a link of bandwidth ``B`` occupies the link for ``len / B`` seconds
  (links are serialized per direction, shared by all connections between the two addresses),
  and arrives ``latency`` seconds after it left;
* each direction of a connection buffers at most ``max(buffer_size, 2 * B * latency)`` bytes
  in flight + unread, so a sender that outruns a slow link or a slow reader blocks;
* a link that is down (``set_link(up=False)`` / ``partition``) delivers nothing until it is
  up again (connections stall, as TCP does, instead of failing), and new dials across it
  fail at once with ``ConnectionRefusedError``;
* ``kill(addr)`` breaks every connection of that address abruptly (both ends see
  ``BrokenResourceError``) and refuses new ones, like a machine that lost power.

Addresses are ``/memory/<n>``; listening on ``/memory/0`` picks a free ``n``. A transport
that dials before listening gets an ephemeral address, used to look up its links.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import trio

from .multiaddr import Multiaddr

_RUN_CONTEXT: object | None
try:  # trio's run loop state: its deadline heap serves as our timer queue (see _Waiter)
    from trio._core._run import GLOBAL_RUN_CONTEXT as _TRIO_RUN_CONTEXT
except ImportError:  # pragma: no cover - a trio without it: cancel scopes instead
    _RUN_CONTEXT = None
else:
    _RUN_CONTEXT = _TRIO_RUN_CONTEXT

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_SIZE = 256 * 1024
_CHUNK = 64 * 1024
_ACCEPT_BACKLOG = 128

AddrLike = Multiaddr | str | int


@dataclass
class LinkConfig:
    latency: float = 0.0
    bandwidth: float | None = None  # bytes per second; None = unlimited
    up: bool = True


def _fast_timers_supported() -> bool:
    """Whether trio's internals look as :class:`_Waiter` expects (checked once, at import)."""
    if _RUN_CONTEXT is None:
        return False
    try:
        from trio._core._run import Deadlines, Runner
    except ImportError:  # pragma: no cover
        return False
    fields = getattr(Runner, "__attrs_attrs__", ())
    return (
        all(hasattr(Deadlines, name) for name in ("add", "remove", "expire", "next_deadline"))
        and any(f.name == "deadlines" for f in fields)
        and hasattr(trio.CancelScope(), "_registered_deadline")
    )


# Tests switch this off to run the fallback (a cancel scope per timed wait).
_FAST_TIMERS = _fast_timers_supported()


class _Waiter:
    """A task parked until woken, cancelled, or trio's clock reaches a deadline.

    Every chunk costs two timed waits (the sender's serialization, the reader's wait for the
    arrival). With a cancel scope each (enter, the deadline fires, Cancelled is raised and
    caught, exit) those waits cost more than the rest of the simulated network together. So a
    deadline goes straight into trio's deadline heap, which the run loop (and MockClock's
    autojump) reads, as an entry that reschedules the task when it expires; it is accounted
    for exactly as a cancel scope's deadline is (``add``; ``remove`` once it is no longer
    current). Where trio's internals differ from what this expects, ``_park`` falls back to
    a cancel scope, with the same timing.
    """

    __slots__ = ("task", "group", "_registered_deadline", "_deadlines")

    def __init__(self, task: trio.lowlevel.Task, group: list[_Waiter] | None) -> None:
        self.task: trio.lowlevel.Task | None = task
        self.group = group
        # what trio's heap compares its entries with: inf = no (longer a) current deadline
        self._registered_deadline = math.inf
        self._deadlines: Any = None

    def arm(self, deadlines: Any, deadline: float) -> None:
        self._deadlines = deadlines
        self._registered_deadline = deadline
        deadlines.add(deadline, self)

    def _disarm(self) -> None:
        if self._registered_deadline != math.inf:
            self._deadlines.remove(self._registered_deadline, self)
            self._registered_deadline = math.inf

    def _leave_group(self) -> None:
        group = self.group
        if group is not None:
            try:
                group.remove(self)
            except ValueError:
                pass

    def wake(self) -> None:
        task = self.task
        if task is not None:
            self.task = None
            self._disarm()
            trio.lowlevel.reschedule(task)

    def _cancel(self, *_args: object) -> None:
        """Called by trio's run loop when the deadline passed (a cancel scope's method name)."""
        self._leave_group()
        self.wake()

    cancel = _cancel  # what older trio versions call on an expired deadline

    def abort(self, _raise_cancel: object) -> trio.lowlevel.Abort:
        self.task = None
        self._disarm()
        self._leave_group()
        return trio.lowlevel.Abort.SUCCEEDED


def _deadline_heap() -> Any:
    """This run's deadline heap where _Waiter may use it, else None."""
    if not _FAST_TIMERS:
        return None
    runner = getattr(_RUN_CONTEXT, "runner", None)
    if runner is None or runner.is_guest:  # guest mode must be told of new deadlines
        return None
    return runner.deadlines


async def _park(group: list[_Waiter] | None, deadline: float = math.inf) -> None:
    """Sleep until woken through ``group`` (:func:`_wake_group`) or until ``deadline``."""
    waiter = _Waiter(trio.lowlevel.current_task(), group)
    if group is not None:
        group.append(waiter)
    if deadline == math.inf:
        await trio.lowlevel.wait_task_rescheduled(waiter.abort)
        return
    deadlines = _deadline_heap()
    if deadlines is not None:
        waiter.arm(deadlines, deadline)
        await trio.lowlevel.wait_task_rescheduled(waiter.abort)
    else:
        with trio.move_on_at(deadline):
            await trio.lowlevel.wait_task_rescheduled(waiter.abort)


def _wake_group(group: list[_Waiter]) -> None:
    for waiter in group:
        waiter.wake()
    group.clear()


def memory_port(addr: AddrLike) -> int:
    """The ``n`` of ``/memory/<n>`` (accepts a Multiaddr, its text, or the number)."""
    if isinstance(addr, int):
        return addr
    return Multiaddr(addr).memory_id()


class _Pipe:
    """One direction of a connection: timed, bounded, breakable."""

    __slots__ = ("net", "src", "dst", "queue", "buffered", "eof", "broken", "closed_by_reader",
                 "readers", "writers")  # fmt: skip

    def __init__(self, net: MemoryNetwork, src: int, dst: int) -> None:
        self.net = net
        self.src = src
        self.dst = dst
        self.queue: deque[tuple[float, bytes]] = deque()  # (arrival time, chunk), in order
        self.buffered = 0
        self.eof = False
        self.broken = False
        self.closed_by_reader = False
        # tasks waiting for data (or EOF, or a state change) / for buffer space
        self.readers: list[_Waiter] = []
        self.writers: list[_Waiter] = []

    def capacity(self, link: LinkConfig) -> int:
        cap = self.net.buffer_size
        if link.bandwidth is not None and link.latency > 0:
            cap = max(cap, int(2 * link.bandwidth * link.latency))
        return cap

    def wake(self) -> None:
        """Wake every task waiting on this direction: its state (or its link) changed."""
        if self.readers:
            _wake_group(self.readers)
        if self.writers:
            _wake_group(self.writers)


class MemoryStream(trio.abc.HalfCloseableStream):
    """One end of an in-memory connection."""

    def __init__(self, net: MemoryNetwork, outgoing: _Pipe, incoming: _Pipe) -> None:
        self._net = net
        self._out = outgoing
        self._in = incoming
        self._closed = False
        self._sending = False
        self.local_port = outgoing.src
        self.remote_port = outgoing.dst

    @property
    def remote_addr(self) -> str:
        return f"/memory/{self.remote_port}"

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this stream")
        self._sending = True
        try:
            await self._send_all(data)
        finally:
            self._sending = False

    async def _send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        pipe = self._out
        if pipe.eof:
            raise trio.ClosedResourceError("send_eof() was already called")
        view = memoryview(data).cast("B")
        total = view.nbytes
        if not total:
            self._check_broken(pipe)
            await trio.lowlevel.checkpoint()
            return
        net = self._net
        offset = 0
        waited = False  # a wait is a checkpoint: no second one at the end
        while offset < total:
            self._check_broken(pipe)
            link = net._link(pipe.src, pipe.dst)
            room = pipe.capacity(link) - pipe.buffered
            if room <= 0:
                await _park(pipe.writers)
                waited = True
                continue
            n = min(_CHUNK, total - offset, room)
            chunk = bytes(view[offset : offset + n])
            offset += n
            pipe.buffered += n
            now = depart = trio.current_time()
            if link.bandwidth is not None:
                key = (pipe.src, pipe.dst)
                depart = max(now, net._link_free_at.get(key, 0.0)) + n / link.bandwidth
                net._link_free_at[key] = depart
            queue = pipe.queue
            queue.append((depart + link.latency, chunk))
            # a reader already waiting for an earlier chunk is not woken: this one is behind it
            if len(queue) == 1 and pipe.readers:
                _wake_group(pipe.readers)
            if depart > now:
                await _park(None, depart)  # the link serializes the chunk
                waited = True
        if not waited:
            await trio.lowlevel.checkpoint()

    def _check_broken(self, pipe: _Pipe) -> None:
        if pipe.broken:
            raise trio.BrokenResourceError("in-memory connection was broken (address killed)")
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        if pipe.closed_by_reader:
            raise trio.BrokenResourceError("the remote closed the connection")

    async def wait_send_all_might_not_block(self) -> None:
        pipe = self._out
        while not pipe.broken and pipe.buffered >= pipe.capacity(
            self._net._link(pipe.src, pipe.dst)
        ):
            await _park(pipe.writers)
        await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream is closed")
        self._out.eof = True
        self._out.wake()
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        pipe = self._in
        waited = False  # a wait is a checkpoint: none is needed after it
        while True:
            if self._closed:
                raise trio.ClosedResourceError("stream is closed")
            if pipe.broken:
                raise trio.BrokenResourceError("in-memory connection was broken (address killed)")
            queue = pipe.queue
            if queue:
                arrival, chunk = queue[0]
                if not self._net._link(pipe.src, pipe.dst).up:
                    await _park(pipe.readers)  # woken by heal()/set_link()
                    waited = True
                    continue
                if arrival > trio.current_time():
                    await _park(pipe.readers, arrival)  # also woken by kill(), link changes
                    waited = True
                    continue
                if not waited:
                    # take the chunk only once no Cancelled can come: a cancelled read
                    # loses nothing
                    await trio.lowlevel.checkpoint()
                    waited = True
                    continue  # the world may have changed meanwhile: look again
                if max_bytes is not None and max_bytes < len(chunk):
                    queue[0] = (arrival, chunk[max_bytes:])
                    chunk = chunk[:max_bytes]
                else:
                    queue.popleft()
                pipe.buffered -= len(chunk)
                if pipe.writers:
                    _wake_group(pipe.writers)
                return chunk
            if pipe.eof:
                if not waited:
                    await trio.lowlevel.checkpoint()
                return b""
            await _park(pipe.readers)
            waited = True

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            # The peer sees EOF after what we sent; what it sends us from now on is dropped.
            self._out.eof = True
            self._in.closed_by_reader = True
            self._in.queue.clear()
            self._in.buffered = 0
            self._out.wake()
            self._in.wake()
            self._net._connections.discard(self)
        await trio.lowlevel.checkpoint()


class MemoryListener:
    """Accepts connections dialed to one ``/memory/<n>`` address."""

    def __init__(self, transport: MemoryTransport, port: int) -> None:
        self.transport = transport
        self.port = port
        self.multiaddr = Multiaddr(f"/memory/{port}")
        self._send, self._recv = trio.open_memory_channel[MemoryStream](_ACCEPT_BACKLOG)
        self.closed = False

    async def accept(self) -> tuple[MemoryStream, str]:
        try:
            stream = await self._recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise trio.ClosedResourceError("listener closed") from None
        return stream, stream.remote_addr

    async def aclose(self) -> None:
        self._close_now()
        await trio.lowlevel.checkpoint()

    def _close_now(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._send.close()
        # Connections dialed but never accepted are dropped.
        while True:
            try:
                stream = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            stream._out.broken = stream._in.broken = True
            stream._out.wake()
            stream._in.wake()
        self._recv.close()
        self.transport.net._listeners.pop(self.port, None)


class MemoryTransport:
    """Transport on a :class:`MemoryNetwork`; same interface as ``TCPTransport``."""

    def __init__(self, net: MemoryNetwork) -> None:
        self.net = net
        self.listeners: list[MemoryListener] = []
        self._ephemeral: int | None = None
        self.killed = False  # set by MemoryNetwork.kill; listening again revives

    def can_dial(self, maddr: Multiaddr) -> bool:
        return maddr.is_memory()

    @property
    def local_port(self) -> int:
        """The address our outgoing connections come from (first listener, else ephemeral)."""
        for listener in self.listeners:
            if not listener.closed:
                return listener.port
        if self._ephemeral is None:
            self._ephemeral = self.net._allocate()
        return self._ephemeral

    async def listen(self, maddr: Multiaddr | str) -> list[MemoryListener]:
        port = memory_port(maddr)
        if port == 0:
            port = self.net._allocate()
        if port in self.net._listeners:
            raise OSError(f"/memory/{port} is already in use")
        if port in self.net._dead:
            self.net._dead.discard(port)  # a restarted node may reuse its address
        self.killed = False
        listener = MemoryListener(self, port)
        self.net._listeners[port] = listener
        self.listeners.append(listener)
        await trio.lowlevel.checkpoint()
        return [listener]

    async def dial(self, maddr: Multiaddr | str, timeout: float = 10.0) -> MemoryStream:  # noqa: ASYNC109
        """Connect; ConnectionRefusedError if nobody listens, the link is down or either end died."""
        await trio.lowlevel.checkpoint()
        port = memory_port(maddr)
        src = self.local_port
        net = self.net
        if self.killed or src in net._dead:
            raise ConnectionRefusedError(f"/memory/{src} was killed")
        listener = net._listeners.get(port)
        if listener is None or listener.closed or port in net._dead:
            raise ConnectionRefusedError(f"nothing listens on /memory/{port}")
        link = net._link(src, port)
        if not link.up:
            raise ConnectionRefusedError(f"link /memory/{src} <-> /memory/{port} is down")
        if link.latency:
            # TCP's SYN/SYN-ACK: the connection exists one round trip after we asked.
            await _park(None, trio.current_time() + 2 * link.latency)
        a_to_b = _Pipe(net, src, port)
        b_to_a = _Pipe(net, port, src)
        ours = MemoryStream(net, a_to_b, b_to_a)
        theirs = MemoryStream(net, b_to_a, a_to_b)
        try:
            listener._send.send_nowait(theirs)
        except (trio.WouldBlock, trio.ClosedResourceError):
            raise ConnectionRefusedError(f"/memory/{port} does not accept connections") from None
        net._connections.add(ours)
        net._connections.add(theirs)
        return ours

    async def aclose(self) -> None:
        for listener in self.listeners:
            await listener.aclose()


class MemoryNetwork:
    """A simulated network. See the module docstring for the model."""

    def __init__(
        self,
        latency: float = 0.0,
        bandwidth: float | None = None,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
    ) -> None:
        if latency < 0 or (bandwidth is not None and bandwidth <= 0):
            raise ValueError("latency must be >= 0 and bandwidth > 0 (or None)")
        self.default = LinkConfig(latency, bandwidth, True)
        self.buffer_size = buffer_size
        self._links: dict[frozenset[int], LinkConfig] = {}
        self._listeners: dict[int, MemoryListener] = {}
        self._connections: set[MemoryStream] = set()
        self._link_free_at: dict[tuple[int, int], float] = {}
        self._dead: set[int] = set()
        self._counter = itertools.count(1)

    def transport(self) -> MemoryTransport:
        return MemoryTransport(self)

    def _allocate(self) -> int:
        while True:
            n = next(self._counter)
            if n not in self._listeners:
                return n

    def _link(self, a: int, b: int) -> LinkConfig:
        return self._links.get(frozenset((a, b)), self.default)

    def _wake_all(self) -> None:
        for stream in list(self._connections):
            stream._in.wake()
            stream._out.wake()

    def set_link(
        self,
        a: AddrLike,
        b: AddrLike,
        latency: float | None = None,
        bandwidth: float | None = None,
        up: bool | None = None,
    ) -> None:
        """Change the link between two addresses (both directions). Omitted values are kept."""
        key = frozenset((memory_port(a), memory_port(b)))
        current = self._links.get(key, self.default)
        self._links[key] = LinkConfig(
            current.latency if latency is None else latency,
            current.bandwidth if bandwidth is None else bandwidth,
            current.up if up is None else up,
        )
        self._wake_all()

    def partition(self, group_a: Iterable[AddrLike], group_b: Iterable[AddrLike]) -> None:
        """Take down every link between the two groups (existing connections stall)."""
        b_ports = [memory_port(x) for x in group_b]
        for a in group_a:
            for b in b_ports:
                self.set_link(a, b, up=False)

    def heal(self) -> None:
        """Bring every link back up (latency/bandwidth settings are kept)."""
        for key, cfg in list(self._links.items()):
            if not cfg.up:
                self._links[key] = LinkConfig(cfg.latency, cfg.bandwidth, True)
        self._wake_all()

    def kill(self, addr: AddrLike) -> None:
        """Abruptly break all connections of ``addr`` and refuse new ones to/from it."""
        port = memory_port(addr)
        self._dead.add(port)
        listener = self._listeners.get(port)
        if listener is not None:
            listener.transport.killed = True
            listener._close_now()
        for stream in list(self._connections):
            if port in (stream.local_port, stream.remote_port):
                stream._in.broken = stream._out.broken = True
                stream._in.wake()
                stream._out.wake()
                self._connections.discard(stream)
        logger.info("memory network: killed /memory/%d", port)
