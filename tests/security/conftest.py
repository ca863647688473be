"""Every security test states its credentials itself: none leaks in from the environment."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_ambient_credential(monkeypatch):
    for name in ("KVPOOL_AUTH_FILE", "KVPOOL_PRINCIPAL"):
        monkeypatch.delenv(name, raising=False)
