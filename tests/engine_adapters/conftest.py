"""Fixtures for the adapter tests (the reference model and `pool` come from tests/conftest.py).

The conformance suite (`conformance.py`) is registered here as the module
`adapter_conformance`, so adapter test files import it by a name no other test folder uses.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


_spec = importlib.util.spec_from_file_location("adapter_conformance", Path(__file__).with_name("conformance.py"))
adapter_conformance = importlib.util.module_from_spec(_spec)
sys.modules["adapter_conformance"] = adapter_conformance
_spec.loader.exec_module(adapter_conformance)
