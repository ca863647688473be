"""The master: the pool's metadata service (object table, node table, placement, leases).

It is never on the data path: clients ask it where an object lives (or where to write one) and
move the bytes to and from store nodes themselves. `MasterService` is the in-process API (the
admin app and the embedded pool call it directly); `kvpool.master.server` puts it on the wire.
"""
