"""The cluster client: the ``RemotePool`` facade over a session (RPC client, node
regions, transports), puts, put grants, reads, the lease cache and handles."""
