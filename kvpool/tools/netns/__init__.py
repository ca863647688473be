"""Test networks of Linux network namespaces (root only): members on one subnet through a hub,
with rate limits (tbf), random loss and one-way cuts (nft), and latency from a delay line
process (this kernel has no netem).

- `fabric`: the namespaces, their links, shaping, cuts and heals; processes inside a member.
- `wire`: the delay line (TUN devices, every packet held `delay_ms`).
- `probe`: plain TCP over the links: round trips, and the raw-socket baseline of the bench.
"""

from kvpool.tools.netns.fabric import Fabric, Member, reap_stale, unavailable

__all__ = ["Fabric", "Member", "reap_stale", "unavailable"]
