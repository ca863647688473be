"""FAKE vLLM v1 engine: plays vLLM's scheduler and worker call sequence against a KV connector.

It mirrors vLLM 0.32 (`vllm_api.MIRRORS_VLLM`). The real vLLM CPU build drives the connector in
tests/engine_adapters/vllm_real; this fake covers what cannot run here: the CUDA backends' layouts
(and the older 5-D ones), kernel blocks, preemption, chunked prefill, outages. Per `step()` it
makes the calls a real engine step makes, in the same order and with the same kinds of arguments:

    scheduler: get_num_new_matched_tokens -> allocate blocks -> update_state_after_alloc
               -> build_connector_meta(scheduler_output)
    worker:    bind_connector_metadata -> start_load_kv -> for each layer:
               [wait_for_layer_load -> attention writes the new KV -> save_kv_layer]
               -> wait_for_save -> get_finished(finished_req_ids)
               -> get_block_ids_with_load_errors -> clear_connector_metadata
    scheduler: load errors roll a request back to its first failed block (it is recomputed);
               finished requests -> request_finished; blocks of delayed requests are freed only
               when the worker's get_finished reports them.

The paged KV cache is a real torch tensor per layer (CPU, or CUDA with `device="cuda"`) in the
layout of the attention backend the engine plays (`vllm_api.FAKE_BACKENDS`, registered in the
config's static forward context as vLLM's model does), with blocks handed out in random order and
optionally split into kernel blocks. The "model" is FAKE: the KV of token p in each layer is a
pseudo-random function of tokens[0..p] (as in a causal model), so equal prefixes have equal KV.
The engine indexes its paged tensors itself, the way each backend's kernel reads them (not
through the connector's views or its probed page maps), so a layout mistake in the connector
shows up as a mismatch.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from fakes.vllm_api import FAKE_BACKENDS, FakeAttentionLayer, FakeKVConnectorRole, cpu_vec_views, kv_last_views


def fake_model_kv(tokens: list[int], num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """FAKE model KV: `[tokens, layers, 2, kv_heads, head_dim]`, token p seeded by tokens[0..p]."""
    out = torch.empty((len(tokens), num_layers, 2, kv_heads, head_dim), dtype=dtype)
    h = xxhash.xxh64()
    for p, t in enumerate(tokens):
        h.update(int(t).to_bytes(4, "little"))
        gen = torch.Generator().manual_seed(h.intdigest() & 0x7FFF_FFFF_FFFF_FFFF)
        out[p] = torch.randn((num_layers, 2, kv_heads, head_dim), generator=gen).to(dtype)
    return out


@dataclass
class FakeRequest:
    """FAKE vllm.v1.request.Request (the fields connectors read)."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None  # the OpenAI request's cache_salt
    local_prefix_tokens: int = 0  # FAKE local prefix-cache hit (block-aligned) on admission
    local_fill: float | None = None  # fill the local prefix with this constant (a probe) instead of its KV
    was_scheduled: bool = False  # scheduled before: a re-admission is a resume from preemption

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class FakeKVCacheBlocks:
    """FAKE vllm KVCacheBlocks: one KV cache group."""

    blocks: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.blocks),)


@dataclass
class FakeNewRequestData:
    """FAKE vllm NewRequestData."""

    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    mm_features: list = field(default_factory=list)


@dataclass
class FakeCachedRequestData:
    """FAKE vllm CachedRequestData."""

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class FakeSchedulerOutput:
    """FAKE vllm SchedulerOutput (the fields connectors read)."""

    scheduled_new_reqs: list[FakeNewRequestData]
    scheduled_cached_reqs: FakeCachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    kv_connector_metadata: Any = None


@dataclass
class FakeForwardContext:
    """FAKE vllm ForwardContext."""

    no_compile_layers: dict[str, Any]
    attn_metadata: Any = None


@dataclass
class FakeStepResult:
    output: FakeSchedulerOutput
    matched: dict[str, int]  # req id -> tokens the connector reported for new requests
    finished: dict[str, tuple[bool, dict | None]]  # req id -> request_finished's answer
    finished_sending: set[str]
    load_errors: set[int]


def alloc_paged(paged_layout: str, num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype,
                device: str = "cpu") -> torch.Tensor:
    shape = {"kv_last": (num_blocks, heads, block_size, 2 * dim), "cpu_vec": (num_blocks, heads, block_size, 2 * dim),
             "nhd": (2, num_blocks, block_size, heads, dim), "flashinfer": (num_blocks, 2, block_size, heads, dim),
             "hnd": (2, num_blocks, heads, block_size, dim)}[paged_layout]
    return torch.zeros(shape, dtype=dtype, device=device)


def _kernel_view(t: torch.Tensor, paged_layout: str, kv: int) -> torch.Tensor:
    """K (kv=0) or V (kv=1) as vLLM's kernels read it, indexed [block, offset, head, dim]."""
    if paged_layout == "kv_last":
        return kv_last_views(t)[kv]
    if paged_layout == "cpu_vec":
        return cpu_vec_views(t)[kv]
    if paged_layout == "nhd":
        return t[kv]
    if paged_layout == "flashinfer":
        return t[:, kv]
    return t[kv].transpose(1, 2)


def write_slots(t: torch.Tensor, paged_layout: str, kv: int, blocks: torch.Tensor, offs: torch.Tensor, vals: torch.Tensor) -> None:
    """vals [n, heads, dim] -> slots (blocks[i], offs[i]) of K (kv=0) or V (kv=1)."""
    _kernel_view(t, paged_layout, kv)[blocks, offs] = vals


def read_slots(t: torch.Tensor, paged_layout: str, kv: int, blocks: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _kernel_view(t, paged_layout, kv)[blocks, offs]


class FakeVllmEngine:
    """FAKE vLLM v1 engine (scheduler + one worker + CPU paged KV cache) driving a KV connector."""

    def __init__(self, vllm_config: Any, connector_cls: type, *, client: Any, num_blocks: int = 64,
                 paged_layout: str = "kv_last", token_budget: int | None = None, seed: int = 0, device: str = "cpu",
                 kernel_block_size: int | None = None):
        self.config = vllm_config
        model = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size
        self.num_layers = model.get_num_layers(vllm_config.parallel_config)
        self.kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
        self.head_dim = model.get_head_size()
        self.dtype = getattr(torch, str(model.dtype).removeprefix("torch."))
        self.paged_layout = paged_layout
        self.device = device
        self.token_budget = token_budget
        self.scheduler = connector_cls(vllm_config, FakeKVConnectorRole.SCHEDULER, None, client=client)
        self.worker = connector_cls(vllm_config, FakeKVConnectorRole.WORKER, None, client=client)
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(self.num_layers)]
        for name in self.layer_names:  # as vLLM's Attention layers register themselves
            vllm_config.compilation_config.static_forward_context[name] = FakeAttentionLayer(FAKE_BACKENDS[paged_layout])
        # vLLM splits a block into kernel blocks when the backend's kernels need smaller ones
        self.kernel_block_size = kernel_block_size or self.block_size
        ratio = self.block_size // self.kernel_block_size
        self.kv_caches = {name: alloc_paged(paged_layout, num_blocks * ratio, self.kernel_block_size, self.kv_heads,
                                            self.head_dim, self.dtype, device) for name in self.layer_names}
        self.worker.register_kv_caches(self.kv_caches)
        self.rng = random.Random(seed)
        self.free_blocks = list(range(num_blocks))
        self.rng.shuffle(self.free_blocks)
        self.waiting: list[FakeRequest] = []
        self.running: dict[str, FakeRequest] = {}
        self.requests: dict[str, FakeRequest] = {}
        self.held: dict[str, list[int]] = {}  # blocks whose freeing the connector delayed
        self._finished_for_workers: set[str] = set()
        self._model_kv: dict[str, torch.Tensor] = {}
        self.layer_hook = None  # optional callable(layer_name, phase) for tests

    def add_request(self, req_id: str, prompt: list[int], *, local_prefix_tokens: int = 0,
                    local_fill: float | None = None, cache_salt: str | None = None) -> FakeRequest:
        """Queue a request; `local_prefix_tokens` plays a hit in vLLM's own (GPU) prefix cache."""
        if local_prefix_tokens % self.block_size:
            raise ValueError("vLLM's local prefix-cache hits are whole blocks")
        req = FakeRequest(req_id, list(prompt), local_prefix_tokens=local_prefix_tokens, local_fill=local_fill,
                          cache_salt=cache_salt)
        self.waiting.append(req)
        self.requests[req_id] = req
        self._model_kv[req_id] = fake_model_kv(req.prompt_token_ids, self.num_layers, self.kv_heads, self.head_dim, self.dtype)
        return req

    def model_kv(self, req_id: str) -> torch.Tensor:
        return self._model_kv[req_id]

    def read_kv(self, req_id: str, start: int, end: int) -> torch.Tensor:
        """What the paged cache holds for tokens [start, end) of a request: [T, layers, 2, heads, dim]."""
        req = self.requests[req_id]
        blocks, offs = self._slots(req, torch.arange(start, end))
        out = torch.empty((end - start, self.num_layers, 2, self.kv_heads, self.head_dim), dtype=self.dtype)
        for li, name in enumerate(self.layer_names):
            for kv in (0, 1):
                out[:, li, kv] = read_slots(self.kv_caches[name], self.paged_layout, kv, blocks, offs).cpu()
        return out

    def _slots(self, req: FakeRequest, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel block, offset) of each token position: vLLM's slot mapping, kernel-block granular."""
        ratio = self.block_size // self.kernel_block_size
        blocks = torch.tensor(req.block_ids, dtype=torch.long)[pos // self.block_size]
        inner = pos % self.block_size
        return (blocks * ratio + inner // self.kernel_block_size).to(self.device), (inner % self.kernel_block_size).to(self.device)

    def _schedule(self) -> tuple[FakeSchedulerOutput, dict[str, int]]:
        budget = self.token_budget if self.token_budget is not None else 1 << 30
        cached, num_sched, new_reqs, matched = FakeCachedRequestData(), {}, [], {}
        for req in self.running.values():
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            cached.req_ids.append(req.request_id)
            cached.new_token_ids.append([])
            cached.new_block_ids.append(None)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            num_sched[req.request_id] = n
            budget -= n
        while self.waiting and budget > 0:
            req = self.waiting[0]
            local = 0 if req.was_scheduled else req.local_prefix_tokens
            hit, is_async = self.scheduler.get_num_new_matched_tokens(req, local)
            assert not is_async, "this fake engine drives synchronous loads only"
            need = -(-req.num_tokens // self.block_size)
            if len(self.free_blocks) < need:
                break
            self.waiting.pop(0)
            req.block_ids = [self.free_blocks.pop(0) for _ in range(need)]  # shuffled at start: random tables
            self._fill_local_prefix(req, local)
            self.scheduler.update_state_after_alloc(req, FakeKVCacheBlocks(req.block_ids), hit or 0)
            req.num_computed_tokens = local + (hit or 0)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.was_scheduled:  # resumed after preemption: a cached request with all-new blocks
                cached.req_ids.append(req.request_id)
                cached.resumed_req_ids.add(req.request_id)
                cached.new_token_ids.append([])
                cached.new_block_ids.append((list(req.block_ids),))
                cached.num_computed_tokens.append(req.num_computed_tokens)
            else:
                new_reqs.append(FakeNewRequestData(req.request_id, req.prompt_token_ids, (list(req.block_ids),),
                                                   req.num_computed_tokens))
            req.was_scheduled = True
            num_sched[req.request_id] = n
            matched[req.request_id] = hit or 0
            budget -= n
            self.running[req.request_id] = req
        out = FakeSchedulerOutput(new_reqs, cached, num_sched, sum(num_sched.values()), self._finished_for_workers)
        self._finished_for_workers = set()
        return out, matched

    def _fill_local_prefix(self, req: FakeRequest, local: int) -> None:
        """What vLLM's local prefix cache would hold in the request's first blocks."""
        if not local:
            return
        blocks, offs = self._slots(req, torch.arange(local))
        for li, name in enumerate(self.layer_names):
            kv = self._model_kv[req.request_id][:local, li].to(self.device)
            if req.local_fill is not None:
                kv = torch.full_like(kv, req.local_fill)
            for which in (0, 1):
                write_slots(self.kv_caches[name], self.paged_layout, which, blocks, offs, kv[:, which])

    def preempt(self, req_id: str) -> None:
        """Preempt a running request as vLLM does: free its blocks, recompute from scratch later."""
        req = self.running.pop(req_id)
        self.free_blocks.extend(req.block_ids)
        req.block_ids, req.num_computed_tokens = [], 0
        self.waiting.insert(0, req)

    def _attention(self, layer_index: int, name: str, out: FakeSchedulerOutput) -> None:
        """FAKE attention layer: writes the model's KV of the scheduled tokens into their slots."""
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            pos = torch.arange(req.num_computed_tokens, req.num_computed_tokens + n)
            blocks, offs = self._slots(req, pos)
            kv = self._model_kv[req_id][pos, layer_index].to(self.device)  # [n, 2, heads, dim]
            for which in (0, 1):
                write_slots(self.kv_caches[name], self.paged_layout, which, blocks, offs, kv[:, which])

    def step(self) -> FakeStepResult:
        out, matched = self._schedule()
        out.kv_connector_metadata = self.scheduler.build_connector_meta(out)
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(FakeForwardContext(dict(self.kv_caches)))
        for i, name in enumerate(self.layer_names):
            worker.wait_for_layer_load(name)
            if self.layer_hook:
                self.layer_hook(name, "loaded")
            self._attention(i, name, out)
            worker.save_kv_layer(name, self.kv_caches[name], None)
        worker.wait_for_save()
        sending, _recving = worker.get_finished(out.finished_req_ids)
        errors = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        return self._update(out, matched, set(sending or ()), errors)

    def _update(self, out: FakeSchedulerOutput, matched: dict[str, int], sending: set[str], errors: set[int]) -> FakeStepResult:
        for req_id, n in out.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        for req in self.running.values():  # a failed load: recompute from the first bad block
            bad = [i for i, b in enumerate(req.block_ids) if b in errors]
            if bad:
                req.num_computed_tokens = min(req.num_computed_tokens, bad[0] * self.block_size)
        finished = {}
        for req_id in [r for r, q in self.running.items() if q.num_computed_tokens >= q.num_tokens]:
            req = self.running.pop(req_id)
            delay, params = self.scheduler.request_finished(req, list(req.block_ids))
            finished[req_id] = (delay, params)
            if delay:
                self.held[req_id] = req.block_ids
            else:
                self.free_blocks.extend(req.block_ids)
            self._finished_for_workers.add(req_id)
        for req_id in sending:
            if req_id not in self.held:
                raise AssertionError(f"worker reported {req_id} as finished sending but its blocks were not held")
            self.free_blocks.extend(self.held.pop(req_id))
        return FakeStepResult(out, matched, finished, sending, errors)

    def run(self, max_steps: int = 50) -> list[FakeStepResult]:
        """Step until nothing is waiting, running or held."""
        results = []
        for _ in range(max_steps):
            if not (self.waiting or self.running or self.held or self._finished_for_workers):
                break
            if not (self.waiting or self.running):
                time.sleep(0.005)  # only background saves are pending: give them a moment
            results.append(self.step())
        return results

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
