"""Lookup (beam search): pending requests count toward the beam, silent peers lose their place."""

import random

import trio

from dht.kademlia.protocol import FindResult
from dht.kademlia.routing import Contact
from dht.kademlia.traverse import Lookup


def make_contacts(n, seed):
    rng = random.Random(seed)
    return [Contact(f"p{i}", rng.getrandbits(256)) for i in range(n)]


async def test_a_lookup_that_knows_everyone_asks_only_the_beam(autojump_clock):
    contacts = make_contacts(40, 1)
    target = random.Random(2).getrandbits(256)
    asked = []

    async def find(contact):
        asked.append(contact.peer_id)
        await trio.sleep(0.01)
        return FindResult(None, contacts)

    lookup = Lookup(target, contacts, find, beam_size=5, alpha=3)
    result = await lookup.run()
    expected = sorted(contacts, key=lambda c: c.node_id ^ target)[:5]
    assert [c.peer_id for c in result.nearest] == [c.peer_id for c in expected]
    # before pending requests counted, the two spare workers asked peers 6 and 7 as well
    assert sorted(asked) == sorted(c.peer_id for c in expected)


async def test_a_silent_peer_in_the_beam_is_replaced_after_patience(autojump_clock):
    contacts = make_contacts(40, 3)
    target = random.Random(4).getrandbits(256)
    ranked = sorted(contacts, key=lambda c: c.node_id ^ target)
    dead = ranked[1].peer_id
    asked_at = {}

    async def find(contact):
        asked_at[contact.peer_id] = trio.current_time() - started
        if contact.peer_id == dead:
            await trio.sleep(3.0)  # the caller's RPC timeout
            return None
        await trio.sleep(0.01)
        return FindResult(None, contacts)

    started = trio.current_time()
    lookup = Lookup(target, contacts, find, beam_size=5, alpha=3, patience=0.5)
    with trio.move_on_after(10):
        result = await lookup.run()
    alive = [c.peer_id for c in ranked if c.peer_id != dead][:5]
    assert [c.peer_id for c in result.nearest] == alive
    # (virtual time) the sixth peer is asked once the dead one has been silent for `patience`:
    # not at once (it would be wasted if the dead one answered), not after its 3 s timeout
    assert result.messages == 6
    assert 0.5 <= asked_at[ranked[5].peer_id] < 1.0
