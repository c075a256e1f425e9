"""``kvpool master``: the cluster's metadata service (see .server).

Not imported by ``import kvpool``: clients only need kvpool.cluster.wire and
``kvpool.config.DEFAULT_PORT``.
"""

from kvpool.cluster.master.config import MasterConfig
from kvpool.cluster.master.server import Master

__all__ = ["Master", "MasterConfig"]
