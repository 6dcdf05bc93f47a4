"""Members that reach each other only through a relay (peers at home behind one public
bootstrap): a round's bytes wait for the hole punch the round's first contact started,
rather than cross the relay. Real TCP over loopback, a real relay and real DCUtR, with the
punching dials held back so that the round surely starts while the punch is under way."""

from __future__ import annotations

import torch

from dht.p2p import Host
from dht.p2p.relay import enable_relay_service, relay_client
from moshpit.averaging.allreduce import AllReduceService
from tests.p2p.test_dcutr import LOCAL, LOOPBACK, SlowPunchTransport

from .test_allreduce import make_group, run_all

NUMEL = 8192  # 32 KiB per member: a relayed round fits a spec-sized circuit (128 KiB)


async def test_a_round_between_relayed_members_waits_for_their_punch():
    async with (
        Host.open(hole_punching=False) as r,
        Host.open(transport=SlowPunchTransport(), hole_punching=LOOPBACK) as a,
        Host.open(transport=SlowPunchTransport(), hole_punching=LOOPBACK) as b,
    ):
        (raddr,) = await r.listen(LOCAL)
        relay = enable_relay_service(r)
        for host in (a, b):
            await host.listen(LOCAL)
        (circuit,) = (await relay_client(b).reserve(r.peer_id, [raddr])).circuit_addrs
        services = [AllReduceService(a), AllReduceService(b)]
        group = make_group(services)
        values = [[torch.full((NUMEL,), float(i))] for i in range(2)]
        before = relay.stats.bytes_forwarded
        # matchmaking's first contact: A dials B's circuit address, the one it knows, and
        # that relayed connection starts the punch; the round begins at once
        await a.connect([circuit])
        assert a.best_connection(b.peer_id).relayed and b.best_connection(a.peer_id).relayed
        # (timeout 60: sender_timeout 20 s, so the parts may wait the whole 5 s for the punch)
        results = await run_all(services, group, values, timeout=60.0)
        relayed = relay.stats.bytes_forwarded - before
        for result in results:
            assert result is not None and result.averaged_fraction == 1.0
            assert torch.equal(result.averaged[0], torch.full((NUMEL,), 0.5))
            assert result.bytes_sent >= NUMEL * 4 // 2
        # the relay carried the connection's set-up and the punch, none of the round's parts
        assert relayed < NUMEL * 4 // 4, relayed
        for host, other in ((a, b), (b, a)):
            assert not host.best_connection(other.peer_id).relayed
