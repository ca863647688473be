"""Cluster mode: membership and leader election in etcd (`--meta etcd://host:port`).

Layout in etcd (every key bound to its owner's lease, so a dead process disappears by itself):
- `/kvpool/leader`              -> the leader master's RPC address
- `/kvpool/masters/<address>`   -> a master (leader or standby)
- `/kvpool/nodes/<node id>`     -> a node's RPC address
- `/kvpool/removed/<put id>/<key>` -> an acknowledged remove, for the next leader (bound to a
  lease of the leader's that ends by itself; `kvpool.cluster.removals`)
"""

from kvpool.cluster.etcd import EtcdClient, parse_etcd_url
from kvpool.cluster.membership import LEADER_KEY, MASTERS_PREFIX, NODES_PREFIX, LeaderElection, Registration, lease_ttl

__all__ = ["EtcdClient", "LEADER_KEY", "LeaderElection", "MASTERS_PREFIX", "NODES_PREFIX", "Registration",
           "lease_ttl", "parse_etcd_url"]
