"""Cluster mode: membership and leader election in etcd (`--meta etcd://host:port`).

Layout in etcd (membership keys are bound to their owner's lease, so a dead process disappears by itself):
- `/kvpool/leader`              -> the leader master's RPC address
- `/kvpool/masters/<address>`   -> a master (leader or standby)
- `/kvpool/nodes/<node id>`     -> a node's RPC address
- `/kvpool/removed/<generation>/<key>` -> a remove's tombstone, for the next leader, deleted by
  the leader once older than `removal_memory_s` (`kvpool.cluster.removals`)
- `/kvpool/removed-horizon`     -> the generation below which tombstones were deleted
- `/kvpool/generation`          -> the ids reserved by the current leader's term
"""

from kvpool.cluster.etcd import EtcdClient
from kvpool.cluster.membership import LEADER_KEY, NODES_PREFIX, LeaderElection, Registration, lease_ttl

__all__ = ["EtcdClient", "LEADER_KEY", "LeaderElection", "NODES_PREFIX", "Registration", "lease_ttl"]
