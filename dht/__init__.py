"""The peer-to-peer network (libp2p-compatible TCP stack) and the Kademlia DHT. Never imports torch."""
