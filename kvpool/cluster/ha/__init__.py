"""Master high availability: leader election on etcd, with self-fencing.

``Coordinator`` is the small interface the election needs (campaign, renew,
look up the leader); ``EtcdCoordinator`` implements it on a real etcd over
its JSON gateway (``pip install kvpool[ha]``), ``MemoryCoordinator`` in
memory for unit tests. ``Election`` runs the campaign / renew loop and the
watchdog that stops a leader from serving before its lease can expire.
Only masters use this package: clients and nodes need no etcd client.
"""

from kvpool.cluster.ha.coordinator import Coordinator, Leader, MemoryCoordinator
from kvpool.cluster.ha.election import Election, ElectionConfig

__all__ = ["Coordinator", "Election", "ElectionConfig", "Leader", "MemoryCoordinator"]
