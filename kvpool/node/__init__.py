"""A store node: `store_node` (`StoreNode`), with its `pins`, `writes` and `master_channel`.
The embedded pool (master and node in one process) is `kvpool.embedded`."""

from kvpool.node.store_node import StoreNode

__all__ = ["StoreNode"]
