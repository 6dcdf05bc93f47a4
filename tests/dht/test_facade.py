"""The synchronous DHT facade over real TCP on loopback: store/get, futures, services, shutdown."""

import concurrent.futures
import threading
import time

import pytest
import trio
import trio.lowlevel

from dht import DHT, BootstrapError, DHTNode, get_dht_time

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def dht_threads():
    return [t for t in threading.enumerate() if t.name == "moshpit-dht"]


def test_store_get_futures_services_and_clean_shutdown(tmp_path):
    before = len(dht_threads())
    with DHT(host_maddrs=LOOPBACK) as first:
        maddrs = first.get_visible_maddrs()
        assert maddrs and all(str(m).endswith(f"/p2p/{first.peer_id}") for m in maddrs)
        with DHT(initial_peers=maddrs, host_maddrs=LOOPBACK) as second:
            assert second.store("plain", {"x": [1, 2]}, get_dht_time() + 30)
            assert first.get("plain").value == {"x": [1, 2]}
            future = second.store("dict", "v1", get_dht_time() + 30, subkey="a", return_future=True)
            assert isinstance(future, concurrent.futures.Future) and future.result(timeout=10)
            assert second.store("dict", "v2", get_dht_time() + 30, subkey="b")
            found = first.get("dict", latest=True, return_future=True).result(timeout=10)
            assert {k: v.value for k, v in found.value.items()} == {"a": "v1", "b": "v2"}
            assert first.get("missing") is None

            async def count_contacts(dht, node):
                assert dht is second and isinstance(node, DHTNode)
                return len(node.routing_table)

            assert second.run_coroutine(count_contacts) == 1

            async def failing(dht, node):
                raise ValueError("boom")

            with pytest.raises(ValueError, match="boom"):
                second.run_coroutine(failing)

            started = threading.Event()

            async def service(tag):
                started.set()
                await trio.sleep_forever()

            forever = second.start_service(service, "svc")
            assert started.wait(10)

            async def short(x):
                await trio.lowlevel.checkpoint()
                return x * 2

            assert second.start_service(short, 21).result(timeout=10) == 42
            cancelled_by_user = second.start_service(service, "other")
            cancelled_by_user.cancel()
        assert forever.cancelled()  # shutdown cancelled the long-lived service
        assert not second.is_alive
        with pytest.raises(RuntimeError, match="not running"):
            second.get("plain")
    assert len(dht_threads()) == before


def test_identity_path_keeps_peer_id_and_bad_bootstrap_raises(tmp_path):
    key = tmp_path / "id.pem"
    with DHT(host_maddrs=LOOPBACK, identity_path=str(key)) as dht:
        first_id = dht.peer_id
    with DHT(host_maddrs=LOOPBACK, identity_path=str(key)) as dht:
        assert dht.peer_id == first_id
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{first_id}"
    started = time.monotonic()
    with pytest.raises(BootstrapError, match="initial peers"):
        DHT(initial_peers=[dead], host_maddrs=LOOPBACK, bootstrap_timeout=5)
    assert time.monotonic() - started < 30
    assert not dht_threads()


def test_a_key_file_in_use_by_a_running_dht_is_refused_until_it_shuts_down(tmp_path):
    from dht.p2p import IdentityInUseError

    key = tmp_path / "id.pem"
    before = len(dht_threads())
    with DHT(host_maddrs=LOOPBACK, identity_path=str(key)) as first:
        with pytest.raises(IdentityInUseError) as info:  # the error itself, not a group
            DHT(host_maddrs=LOOPBACK, identity_path=str(key))
        assert str(info.value).startswith(
            f"identity file {key} is already in use by a peer in this process"
        )
        assert len(dht_threads()) == before + 1  # the refused one left no thread behind
        assert first.is_alive
    # shutdown released the key: the same PeerID starts again at once
    with DHT(host_maddrs=LOOPBACK, identity_path=str(key)) as again:
        assert again.peer_id == first.peer_id
    assert len(dht_threads()) == before


def test_client_mode_facade_and_shutdown_is_idempotent():
    with DHT(host_maddrs=LOOPBACK) as server:
        client = DHT(initial_peers=server.get_visible_maddrs(), client_mode=True)
        assert client.get_visible_maddrs() == []
        assert client.store("k", 1, get_dht_time() + 10)
        assert server.get("k").value == 1
        assert client.peer_id not in server.node.routing_table
        client.shutdown()
        client.shutdown()
    assert not dht_threads()


def test_interpreter_exit_without_shutdown_is_clean(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import dht, threading\n"
        "a = dht.DHT(host_maddrs=['/ip4/127.0.0.1/tcp/0'])\n"
        "b = dht.DHT(initial_peers=['/ip4/127.0.0.1/tcp/9/p2p/' + str(a.peer_id)] + a.get_visible_maddrs(),"
        " host_maddrs=['/ip4/127.0.0.1/tcp/0'])\n"
        "assert b.store('k', 1, dht.get_dht_time() + 10)\n"
        "print('ok', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert "Traceback" not in done.stderr


def test_many_owner_signed_subkeys_are_verified_in_worker_threads():
    with (
        DHT(host_maddrs=LOOPBACK) as first,
        DHT(initial_peers=first.get_visible_maddrs(), host_maddrs=LOOPBACK) as second,
    ):
        key = "matchmaking.0b0101"
        items = [(key, f"[owner:{second.peer_id}]#{i}", i, get_dht_time() + 100) for i in range(40)]
        assert all(second.store_many(items).values())
        assert first.node.storage.num_records == 40  # verified (in a thread) and stored
        found = first.get(key, latest=True)
        assert {k: v.value for k, v in found.value.items()} == {sub: i for _, sub, i, _ in items}


def test_calls_racing_with_shutdown_fail_cleanly():
    dht = DHT(host_maddrs=LOOPBACK)
    futures = [dht.get(f"k{i}", return_future=True) for i in range(50)]
    stopper = threading.Thread(target=dht.shutdown)
    stopper.start()
    late = []
    for i in range(50):
        try:
            late.append(dht.get(f"late{i}", return_future=True))
        except RuntimeError:
            pass
    stopper.join()
    for future in futures + late:
        try:
            future.result(timeout=10)
        except (RuntimeError, concurrent.futures.CancelledError):
            pass
    assert not dht_threads()


def test_startup_timeout_then_shutdown_does_not_hang():
    import socket

    from .conftest import Identity

    silent = socket.socket()  # accepts connections but never speaks: the handshake stalls
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        port = silent.getsockname()[1]
        fake = f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.generate().peer_id}"
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not start"):
            DHT(
                initial_peers=[fake], host_maddrs=LOOPBACK, startup_timeout=0.5, bootstrap_timeout=3
            )
        assert time.monotonic() - started < 20
        assert not dht_threads()
    finally:
        silent.close()
