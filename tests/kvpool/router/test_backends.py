"""The `Backend` contract (kvpool/router/backends/base.py), run by every backend: its HTTP clients
are its own (made in `start`, closed in `close`), and its polls map failures to the router's
terms (a refused connection is `WorkerRefused`: out of rotation at once; any other failure a plain
`Unavailable`: out after `FAIL_AFTER` polls). Real loopback sockets; what each backend runs on
a request is tested with its workers (test_router_pool_match.py, test_router_vllm_tenants.py,
tests/e2e/test_router*.py)."""

from __future__ import annotations

import asyncio

import pytest

from kvpool import worker_api as wire
from kvpool.errors import Unavailable
from kvpool.router.backends import ENGINES, make_backend
from kvpool.router.backends.base import WorkerRefused
from kvpool.router.backends.vllm import VLLMSettings
from kvpool.router.workers import WorkerState
from kvpool.tools.launch.processes import free_port


def backend_of(engine: str):
    return make_backend(engine, VLLMSettings("/nonexistent-model-folder"))


def state_at(url: str) -> WorkerState:
    info = wire.WorkerInfo(role="both", model_id="m", namespace="0" * 32, chunk_tokens=16, dtype="float32",
                           pool="", eos_token_ids=[])
    return WorkerState(url=url, name="both-1", info=info)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_backend_owns_its_clients(engine):
    async def run():
        backend = backend_of(engine)
        assert backend.engine == engine and backend.http is None
        await backend.start()
        assert not backend.http.closed
        await backend.close()
        assert backend.http.closed

    asyncio.run(run())


@pytest.mark.parametrize("engine", ENGINES)
def test_a_refused_connection_is_worker_refused_and_an_error_page_is_not(engine):
    from aiohttp import web

    async def run():
        backend = backend_of(engine)
        await backend.start()
        async def broken_page(request):
            return web.Response(status=500, text="broken")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", broken_page)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        broken = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            with pytest.raises(WorkerRefused):
                await backend.poll(state_at(f"http://127.0.0.1:{free_port()}"))
            with pytest.raises(WorkerRefused):
                await backend.describe(f"http://127.0.0.1:{free_port()}", None)
            with pytest.raises(Unavailable) as answered:
                await backend.poll(state_at(broken))
            assert not isinstance(answered.value, WorkerRefused) and "500" in str(answered.value)
        finally:
            await backend.close()
            await runner.cleanup()

    asyncio.run(run())
