"""Moved to `kvpool.worker_api`: the workers' wire messages are the router's contract too, and
nothing in kvpool imports engine_adapters. Edit that file, not this one."""

from kvpool.worker_api import *  # noqa: F401,F403
from kvpool.worker_api import _encoder  # noqa: F401
