"""The least an encrypted all-reduce written in Python costs: a floor for bench_averaging.py.

A butterfly all-reduce (reduce-scatter, then all-gather) of one float32 tensor between P
processes over plain TCP, with every payload byte sealed by its sender and opened by its
receiver with AES-256-GCM in frames the size of Noise's (65519 plaintext bytes, a 2-byte length,
a 16-byte tag), batched into 1 MiB writes and read back in 1 MiB reads, as moshpit's Noise
channel does. Nothing else: no handshake (a key comes from the parent), no multiplexing, no
event loop, no validation, no timeouts, no fault tolerance; one thread per peer and direction
on blocking sockets.

What moshpit's all-reduce costs above this is the price of its protocol and its event loop;
what this costs above gloo is the price of encryption, of the kernel's copies and of Python's
work per frame, which no change to moshpit's protocol can remove.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
from collections.abc import Callable

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

TAG = 16
MAX_PLAIN = 0xFFFF - TAG
IO_SIZE = 1 << 20
_LEN = struct.Struct(">H")


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "little")  # Noise's nonce layout


class Link:
    """One TCP connection to one peer, each direction with its own key and nonce counter."""

    def __init__(self, sock: socket.socket, send_key: bytes, receive_key: bytes) -> None:
        self.sock = sock
        self._seal = AESGCM(send_key)
        self._open = AESGCM(receive_key)
        self._sent = 0
        self._received = 0
        self._out = bytearray(IO_SIZE + 2 * (2 + 0xFFFF))
        self._in = bytearray(IO_SIZE)
        self._have = 0  # bytes read into ``_in`` and not yet decrypted

    def send(self, data: memoryview) -> None:
        out = memoryview(self._out)
        pos = 0
        for start in range(0, len(data), MAX_PLAIN):
            chunk = data[start : start + MAX_PLAIN]
            size = len(chunk) + TAG
            _LEN.pack_into(out, pos, size)
            self._seal.encrypt_into(_nonce(self._sent), chunk, None, out[pos + 2 : pos + 2 + size])
            self._sent += 1
            pos += 2 + size
            if pos >= IO_SIZE:
                self.sock.sendall(out[:pos])
                pos = 0
        if pos:
            self.sock.sendall(out[:pos])

    def receive_into(self, dest: memoryview) -> None:
        """Fill ``dest`` with the plaintext of the next frames (``len(dest)`` bytes of it).

        A read may bring bytes of the frames after these (the peer's next transfer): they stay
        at the start of the buffer for the next call.
        """
        buf = memoryview(self._in)
        o = 0
        while True:
            pos = 0
            while o < len(dest) and self._have - pos >= 2:
                (length,) = _LEN.unpack_from(buf, pos)
                if self._have - pos - 2 < length:
                    break
                size = length - TAG
                frame = buf[pos + 2 : pos + 2 + length]
                self._open.decrypt_into(_nonce(self._received), frame, None, dest[o : o + size])
                self._received += 1
                o += size
                pos += 2 + length
            buf[: self._have - pos] = buf[pos : self._have]
            self._have -= pos
            if o == len(dest):
                return
            got = self.sock.recv_into(buf[self._have :])
            if not got:
                raise ConnectionError("peer closed the connection mid-transfer")
            self._have += got


def _run_all(jobs: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _receive_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("peer closed the connection during set-up")
        data += got
    return data


def _direction_key(key: bytes, sender: int, receiver: int) -> bytes:
    return hashlib.sha256(key + sender.to_bytes(4, "big") + receiver.to_bytes(4, "big")).digest()


class Mesh:
    """This rank's connections to every other rank, and the butterfly all-reduce over them."""

    def __init__(self, rank: int, host: str = "127.0.0.1") -> None:
        self.rank = rank
        self._listener = socket.create_server((host, 0))
        self.port: int = self._listener.getsockname()[1]
        self.links: dict[int, Link] = {}

    def connect(self, addrs: list[tuple[str, int]], key: bytes) -> None:
        """Dial every higher rank and accept every lower one (``addrs``: host and port by rank)."""

        def link(sock: socket.socket, peer: int) -> Link:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_key = _direction_key(key, self.rank, peer)
            return Link(sock, send_key, _direction_key(key, peer, self.rank))

        def accept_lower() -> None:
            for _ in range(self.rank):
                sock, _ = self._listener.accept()
                peer = int.from_bytes(_receive_exactly(sock, 4), "big")
                self.links[peer] = link(sock, peer)

        accepting = threading.Thread(target=accept_lower)
        accepting.start()
        for peer in range(self.rank + 1, len(addrs)):
            sock = socket.create_connection(addrs[peer])
            sock.sendall(self.rank.to_bytes(4, "big"))
            self.links[peer] = link(sock, peer)
        accepting.join()

    def allreduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (contiguous float32) over all ranks, in place."""
        world = len(self.links) + 1
        numel = tensor.numel()
        bounds = [numel * i // world for i in range(world + 1)]
        parts = [tensor[bounds[i] : bounds[i + 1]] for i in range(world)]
        mine = parts[self.rank]
        received = {peer: torch.empty_like(mine) for peer in self.links}

        def send(peer: int, part: torch.Tensor) -> Callable[[], None]:
            return lambda: self.links[peer].send(_bytes(part))

        def receive(peer: int, into: torch.Tensor) -> Callable[[], None]:
            return lambda: self.links[peer].receive_into(_bytes(into))

        # reduce-scatter: every rank sums one part
        _run_all(
            [send(peer, parts[peer]) for peer in self.links]
            + [receive(peer, received[peer]) for peer in self.links]
        )
        for part in received.values():
            mine.add_(part)
        # all-gather: every rank's sum to every other rank
        _run_all(
            [send(peer, mine) for peer in self.links]
            + [receive(peer, parts[peer]) for peer in self.links]
        )

    def close(self) -> None:
        for link in self.links.values():
            link.sock.close()
        self._listener.close()


def _bytes(part: torch.Tensor) -> memoryview:
    return memoryview(part.numpy()).cast("B")
