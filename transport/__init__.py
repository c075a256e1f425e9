"""Moving bytes between processes and hosts (installed as ``kvpool.transport``).

- ``base``: ``RegionInfo`` (what a node advertises) and the ``Transport`` interface
  (``read_into(offset, out)`` / ``write(offset, data)`` and batch forms);
- ``shm``: same host, map the node's /dev/shm arena and copy once;
- ``tcp`` / ``tcp_conn`` / ``tcp_server`` / ``tcp_wire``: zero-copy socket path;
- ``ucx`` / ``ucx_server``: UCXX (optional extra), for RDMA / GPU transports;
- ``select``: ``select_transport(peer)`` picks the fastest that reaches a peer;
- ``peers``: ``expose_region`` (node side) and ``PeerTransports`` (client side).
"""
