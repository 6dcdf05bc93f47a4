"""The reachability rules without sockets: ``reachability.decide`` and ``settle`` are pure
functions of a round's evidence, so every case a young swarm meets, and every lie a single
peer can tell, is checked here directly (the NAT test bed runs them for real)."""

from __future__ import annotations

import ipaddress

import pytest

from dht.p2p.multiaddr import Multiaddr
from dht.p2p.reachability import (
    Arrivals,
    Evidence,
    Reachability,
    ReachabilityStatus,
    decide,
    globally_routable,
    settle,
)

PUBLIC, PRIVATE, UNKNOWN = (
    ReachabilityStatus.PUBLIC,
    ReachabilityStatus.PRIVATE,
    ReachabilityStatus.UNKNOWN,
)
NEED = 3
ip = ipaddress.ip_address
BOOT = ip("203.0.113.10")  # a bootstrap VM's interface address
ROUTER = ip("203.0.113.101")  # a home router's public address, as the bootstrap sees it
LAN = ip("192.168.1.2")


def verdict(**fields) -> Reachability:
    return decide(Evidence(**fields), NEED, now=1000.0)


@pytest.mark.parametrize(
    "text, routable",
    [
        ("203.0.113.10", True),  # documentation ranges stand for the Internet in test beds
        ("198.51.100.7", True),
        ("198.18.0.1", True),
        ("8.8.8.8", True),
        ("2001:db8::1", True),
        ("::ffff:8.8.8.8", True),
        ("10.215.0.1", False),  # private use: what NATs hide hosts in
        ("172.16.5.5", False),
        ("192.168.1.2", False),
        ("100.64.0.1", False),  # carrier-grade NAT
        ("127.0.0.1", False),
        ("169.254.1.1", False),
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("::1", False),
        ("fd00::1", False),  # unique local
        ("fe80::1", False),
        ("::ffff:192.168.1.2", False),
    ],
)
def test_globally_routable(text: str, routable: bool) -> None:
    assert globally_routable(ip(text)) is routable


# -- the threshold, as before, for a swarm that has the servers ------------------------------------


def test_threshold_rules_are_unchanged() -> None:
    assert verdict(dialed_back=3).status is PUBLIC
    assert not verdict(dialed_back=3).provisional
    assert verdict(could_not=3).status is PRIVATE
    assert verdict(could_not=3, dialed_back=1).status is UNKNOWN
    # two dialed back, one could not: three verdicts, no agreement, no young-swarm shortcut
    # even with a global address and inbound connections
    mixed = verdict(dialed_back=2, could_not=1, arrivals=2, global_addrs=(BOOT,),
                    connected_from=(ROUTER,))  # fmt: skip
    assert mixed.status is UNKNOWN and "3 must agree" in mixed.reason


# -- a young swarm: the bootstrap ------------------------------------------------------------------


def test_a_bootstrap_with_a_global_address_is_public_once_a_peer_connects_from_elsewhere() -> None:
    alone = verdict(global_addrs=(BOOT,))
    assert alone.status is UNKNOWN and alone.reason == "no connected peer to ask"
    public = verdict(global_addrs=(BOOT,), connected_from=(ROUTER,))
    assert public.status is PUBLIC and public.provisional
    assert "203.0.113.10 is global and 1 peer at other addresses connected" in public.reason
    # its one volunteer dialed it back too: still fewer verdicts than the threshold
    also = verdict(dialed_back=1, arrivals=1, global_addrs=(BOOT,), connected_from=(ROUTER,))
    assert also.status is PUBLIC and also.provisional


def test_no_public_verdict_without_a_global_address_or_without_a_connection() -> None:
    # 10.x on the interface: could be a LAN behind a NAT, a connection from it proves little
    assert verdict(global_addrs=(), connected_from=(ROUTER,)).status is UNKNOWN
    # a claim of a dial-back is not a connection
    assert verdict(dialed_back=1, global_addrs=(BOOT,)).status is UNKNOWN


# -- a young swarm: a volunteer behind a NAT -------------------------------------------------------


def test_a_volunteer_seen_at_a_foreign_address_that_one_server_cannot_reach_is_private() -> None:
    private = verdict(could_not=1, seen_at=(ROUTER,))
    assert private.status is PRIVATE and private.provisional
    assert "1 of 1 peers could not dial this peer back" in private.reason
    assert "203.0.113.101, which none of its interfaces holds (behind NAT" in private.reason
    # no NAT on the way (seen at its own address): a failed dial-back alone is not enough
    assert verdict(could_not=1, seen_at=()).status is UNKNOWN
    # silence and refusals are no verdict
    assert verdict(no_verdict=1, seen_at=(ROUTER,)).status is UNKNOWN


def test_one_server_claiming_a_dial_back_does_not_make_a_nated_peer_reachable() -> None:
    # the honest bootstrap could not; a liar says it could, but nothing connected
    lied = verdict(could_not=1, dialed_back=1, arrivals=0, seen_at=(ROUTER,))
    assert lied.status is PRIVATE and lied.provisional
    # a dial-back that really arrived (a port forward): no private verdict
    forwarded = verdict(could_not=1, dialed_back=1, arrivals=1, seen_at=(ROUTER,))
    assert forwarded.status is UNKNOWN


def test_a_liar_cannot_make_a_peer_without_a_global_address_public() -> None:
    # claims and a connection from the liar itself: without a global address, unknown
    lied = verdict(dialed_back=2, arrivals=2, connected_from=(ROUTER,), global_addrs=())
    assert lied.status is UNKNOWN


# -- what holds between rounds ---------------------------------------------------------------------


def test_an_inconclusive_round_keeps_a_decision() -> None:
    decided = verdict(could_not=3)
    empty = Evidence(no_verdict=2)
    assert settle(decided, decide(empty, NEED, 1.0), empty) is decided
    provisional = verdict(could_not=1, seen_at=(ROUTER,))
    assert settle(provisional, decide(empty, NEED, 1.0), empty) is provisional


def test_a_provisional_private_verdict_falls_when_a_server_really_dials_back() -> None:
    # a single liar made a reachable peer (behind a port forward) believe it was private...
    lie = verdict(could_not=1, seen_at=(ROUTER,))
    # ...until the next round, where an honest server's dial-back arrives
    honest = Evidence(dialed_back=1, could_not=1, arrivals=1, seen_at=(ROUTER,))
    after = settle(lie, decide(honest, NEED, 2.0), honest)
    assert after.status is UNKNOWN
    # the liar alone claiming an OK in the next round changes nothing (no connection came)
    claim = Evidence(dialed_back=1, arrivals=0, seen_at=(ROUTER,))
    assert settle(lie, decide(claim, NEED, 2.0), claim) is lie
    # a threshold verdict is not overturned by one arriving dial-back
    firm = verdict(could_not=3)
    assert settle(firm, decide(honest, NEED, 2.0), honest) is firm


def test_a_decisive_round_replaces_a_provisional_verdict() -> None:
    lie = verdict(could_not=1, seen_at=(BOOT,))
    public = Evidence(global_addrs=(BOOT,), connected_from=(ROUTER,))
    assert settle(lie, decide(public, NEED, 2.0), public).status is PUBLIC
    three = Evidence(dialed_back=3, reached_at=(Multiaddr("/ip4/203.0.113.10/tcp/4001"),))
    after = settle(lie, decide(three, NEED, 2.0), three)
    assert after.status is PUBLIC and not after.provisional
    assert after.public_addrs == (Multiaddr("/ip4/203.0.113.10/tcp/4001"),)


# -- the arrivals log ------------------------------------------------------------------------------


class _Conn:
    def __init__(self, punched: bool = False) -> None:
        self.hole_punched = punched


def test_arrivals_count_rounds_skip_our_own_and_punched_ones_and_age_out() -> None:
    now = [100.0]
    log = Arrivals(ttl=60.0, max_kept=3, clock=lambda: now[0])
    log.record(ip("127.0.0.1"), _Conn())
    log.record(ROUTER, _Conn())
    punched = _Conn()
    log.record(ip("203.0.113.102"), punched)
    assert log.sources(ours=(BOOT,)) == (ip("203.0.113.102"), ROUTER)  # newest first
    punched.hole_punched = True  # hole punching marks it after it registered
    assert log.sources() == (ROUTER,)
    now[0] = 120.0
    log.record(BOOT, _Conn())  # the 4th: the oldest (loopback) is dropped
    assert log.since(110.0) == 1 and log.since(0.0) == 2
    assert log.sources(ours=(BOOT,)) == (ROUTER,)
    now[0] = 170.0  # the first ones are older than the ttl now
    assert log.since(0.0) == 1 and log.sources() == (BOOT,)
