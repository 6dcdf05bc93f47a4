"""The peer-to-peer network (libp2p-compatible TCP stack) and the Kademlia DHT. Never imports torch.

``from dht import DHT, DHTNode, ValueWithExpiration, get_dht_time``: ``DHTNode.open(...)`` is the
async (trio) API, ``DHT(...)`` the synchronous facade that runs a node in a background thread.
"""

from dht.facade import DHT
from dht.kademlia.clock import dht_clock, get_dht_time, trio_clock
from dht.kademlia.errors import BootstrapError, DHTError, DHTProtocolError, RecordRejectedError
from dht.kademlia.node import DHTNode
from dht.kademlia.records import ValueWithExpiration
from dht.kademlia.storage import StorageLimits
from dht.kademlia.validation import OwnerSignatureValidator, RecordValidator

open_node = DHTNode.open

__all__ = [
    "DHT",
    "BootstrapError",
    "DHTError",
    "DHTNode",
    "DHTProtocolError",
    "OwnerSignatureValidator",
    "RecordRejectedError",
    "RecordValidator",
    "StorageLimits",
    "ValueWithExpiration",
    "dht_clock",
    "get_dht_time",
    "open_node",
    "trio_clock",
]
