"""libp2p-compatible transport stack: identity, multiaddr, multistream-select, Noise, yamux, Host."""
