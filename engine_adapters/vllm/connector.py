"""`KVPoolConnector`: the class vLLM instantiates, once per role and process.

As vLLM's own connectors do (NIXL, LMCache), it builds the half its role needs and forwards
vLLM's calls to it: `scheduler.SchedulerSide` in the scheduler process, `worker.WorkerSide` in
each worker; the step's plan travels between them as `metadata.KVPoolConnectorMetadata`. Where
vLLM is installed it subclasses vLLM's `KVConnectorBase_V1`; without vLLM the base is `object`,
so the connector still imports (the tests drive it with a FAKE engine).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from engine_adapters.compat import require
from engine_adapters.vllm.metadata import KVPoolConnectorMetadata
from engine_adapters.vllm.scheduler import SchedulerSide
from engine_adapters.vllm.settings import ConnectorSettings
from engine_adapters.vllm.worker import WorkerSide
from kvpool.contract import PoolClient

try:  # the real base class where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    VLLM_AVAILABLE = True
except ImportError:
    KVConnectorBase_V1 = object
    VLLM_AVAILABLE = False

logger = logging.getLogger(__name__)


class KVPoolConnector(KVConnectorBase_V1):
    """vLLM KV connector (v1 API) backed by the kvpool. One instance per role and process."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None, *, client: PoolClient | None = None):
        if VLLM_AVAILABLE:
            require("vllm")  # an untested vLLM release is refused here, with the reason, not mid-forward
            if "kv_cache_config" in inspect.signature(KVConnectorBase_V1.__init__).parameters:
                super().__init__(vllm_config, role, kv_cache_config)
            else:  # vLLM before 0.11 constructs connectors with (vllm_config, role)
                super().__init__(vllm_config, role)
        self._connector_metadata: Any = None
        self.settings = ConnectorSettings.from_vllm_config(vllm_config)
        ktc = vllm_config.kv_transfer_config
        if self.settings.loads and getattr(ktc, "kv_load_failure_policy", None) == "fail":
            logger.warning("kv_load_failure_policy is 'fail' (vLLM's default): a chunk evicted or damaged between lookup "
                           "and load fails its request instead of being recomputed; set \"kv_load_failure_policy\": "
                           "\"recompute\" in --kv-transfer-config")
        self._client = client
        self._owns_client = client is None
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if str(getattr(role, "name", role)).upper() == "SCHEDULER":  # vLLM's KVConnectorRole, or its name
            self.scheduler_side = SchedulerSide(self.settings, self._pool)
        else:
            self.worker_side = WorkerSide(self.settings, vllm_config, self._pool, self._tp_rank(ktc))

    def _pool(self) -> PoolClient:
        """The pool client (connected on first use when none was given)."""
        if self._client is None:
            import kvpool

            self._client = kvpool.connect(self.settings.address)
        return self._client

    def _tp_rank(self, ktc: Any) -> int:
        extra = getattr(ktc, "kv_connector_extra_config", None) or {}
        if "tp_rank" in extra:
            return int(extra["tp_rank"])
        if VLLM_AVAILABLE and self.settings.tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        return 0

    @property
    def _scheduler(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("a scheduler-side method was called on KVPoolConnector's worker instance")
        return self.scheduler_side

    @property
    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise RuntimeError("a worker-side method was called on KVPoolConnector's scheduler instance")
        return self.worker_side

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: loads and saves run in the per-layer hooks, which full CUDA graphs would skip."""
        return True

    @property
    def stats(self) -> dict[str, int]:
        """Counters of this instance's side (lookups and hits, or loaded/saved chunks and errors)."""
        side = self.scheduler_side or self.worker_side
        return dict(side.stats)

    @property
    def paged_layout(self) -> str | None:
        """How this worker moves blocks: a view layout's name, or "probed" (None before registration)."""
        io = self.worker_side._io if self.worker_side is not None else None
        return None if io is None else io.name

    def add_listener(self, callback: Any) -> None:
        """KVEvent callbacks ("stored" / "removed" chunk keys) for the router's prefix index."""
        self._worker.add_listener(callback)

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVPoolConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    # ---- worker side ----

    def bind_connector_metadata(self, connector_metadata: KVPoolConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None
        if self.worker_side is not None:
            self.worker_side.end_step()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(self._connector_metadata, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self._owns_client and self._client is not None:
            self._client.close()
            self._client = None
