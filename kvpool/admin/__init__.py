"""The REST admin API (FastAPI) and Prometheus metrics of kvpool services.

Wiring, in the master process:

    from kvpool.admin import create_app, serve_in_thread
    handle = serve_in_thread(create_app(master.admin, settings), settings.pool.host, settings.pool.admin_port)
    ...
    handle.stop()

In a store node: `metrics = ServiceMetrics("node", node_id); metrics.watch_stats(store.stats);
serve_metrics(metrics.registry, host, port)`.
"""

from kvpool.admin.app import create_app
from kvpool.admin.metrics import ServiceMetrics, StatsCollector, serve_metrics
from kvpool.admin.server import ServerHandle, serve_in_thread

__all__ = ["ServerHandle", "ServiceMetrics", "StatsCollector", "create_app", "serve_in_thread", "serve_metrics"]
