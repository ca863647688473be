"""The fuzz tests' summary: how many inputs each target tried (helpers: fuzz_support.py, a
module name no other test folder uses)."""

import pytest

from fuzz_support import TRIED


def pytest_terminal_summary(terminalreporter):
    if TRIED:
        terminalreporter.section("fuzz inputs tried per target")
        for target, n in sorted(TRIED.items()):
            terminalreporter.write_line(f"{target:40s} {n}")


@pytest.fixture(scope="session")
def worker_http():
    """A TestClient of a real worker (role both, the reference model, an embedded pool of its own)."""
    pytest.importorskip("torch")
    from reference_worker.model import is_cached

    if not is_cached():
        pytest.skip("the reference model is not converted yet (reference_worker/model.py, `make run` does it)")
    from fastapi.testclient import TestClient

    import kvpool
    from reference_worker.model import load_reference_model
    from reference_worker.app import create_app
    from reference_worker.service import Worker, WorkerConfig
    from kvpool.config import load_settings
    from kvpool.embedded import EmbeddedPool

    model = load_reference_model()
    with EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity="64MiB")) as ep:
        client = kvpool.connect(ep.address)
        worker = Worker(WorkerConfig(role="both", pool=ep.address, chunk_tokens=16), model, client)
        worker.start(warmup=False)
        try:
            with TestClient(create_app(worker), raise_server_exceptions=False) as http:
                yield http
        finally:
            worker.stop()
            client.close()
