"""The REST admin API (FastAPI) and Prometheus metrics of kvpool services: a master serves
`create_app(master.admin, settings)` with `serve_in_thread`, a store node its `ServiceMetrics`
with `serve_metrics` (see `kvpool.cli.master`, `kvpool.cli.node`)."""

from kvpool.admin.app import create_app
from kvpool.admin.metrics import ServiceMetrics, StatsCollector, serve_metrics
from kvpool.admin.server import ServerHandle, serve_in_thread

__all__ = ["ServerHandle", "ServiceMetrics", "StatsCollector", "create_app", "serve_in_thread", "serve_metrics"]
