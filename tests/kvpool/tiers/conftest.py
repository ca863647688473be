from __future__ import annotations

import pytest

from kvpool.tiers import TieredStore


@pytest.fixture
def make_store(tmp_path):
    stores: list[TieredStore] = []

    def make(dram=1 << 20, ssd=0, policy="lru", **kw):
        store = TieredStore(dram, ssd_path=str(tmp_path / f"ssd{len(stores)}") if ssd else None,
                            ssd_capacity=ssd, policy=policy, **kw)
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()
