"""Kademlia DHT on top of dht.p2p."""
