"""Chaos campaigns: a real cluster on loopback (etcd, masters, nodes with DRAM and SSD), load
clients in other processes, a seeded fault schedule, and a checker of what the pool promises.

- `procs`: the processes (start, SIGKILL, SIGSTOP/SIGCONT, restart on the same port).
- `proxy`: a TCP proxy that delays, blackholes or cuts connections.
- `cluster`: the cluster and its proxies; `faults`: the schedule; `load`: one load client.
- `checker`: the promises, checked; `campaign`: all of it, end to end (`kvpool chaos`).
- `soak`, `leaks`: a long load with clients killed, and the judge of flat resource series.
- `command`, `soak_command`: the `kvpool chaos` and `kvpool soak` commands.
"""
