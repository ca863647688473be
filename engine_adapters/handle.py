"""Moved to `kvpool.handle` (the router, in kvpool, passes handles between workers)."""

from kvpool.handle import HANDLE_VERSION, KVHandle  # noqa: F401
