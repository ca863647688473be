"""An untested engine release is refused up front, with a message that says what to do."""

from __future__ import annotations

import pytest

from engine_adapters import compat


@pytest.mark.parametrize("version,want", [("0.32.0", "0.32"), ("0.5.6.post1", "0.5"), ("1.4.2", "1"),
                                          ("0.32.0+cpu", "0.32")])
def test_series(version, want):
    assert compat.series(version) == want


def test_tested_series_pass_and_others_are_refused_clearly(monkeypatch):
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    assert compat.require("vllm", "0.32.1") == "0.32.1"
    assert compat.require("lmcache", "0.5.6") == "0.5.6"
    for engine, version in (("vllm", "0.33.0"), ("vllm", "1.0.0"), ("sglang", "0.6.0"), ("lmcache", "0.4.2")):
        with pytest.raises(compat.UntestedVersion) as exc:
            compat.require(engine, version)
        text = str(exc.value)
        assert version in text and "docs/compatibility.md" in text and compat.ALLOW_ENV in text


def test_the_override_warns_instead(monkeypatch, caplog):
    monkeypatch.setenv(compat.ALLOW_ENV, "1")
    assert compat.require("vllm", "0.40.0") == "0.40.0"
    assert "0.40.0" in caplog.text


def test_the_installed_engines_are_the_tested_ones():
    """Whatever this environment has installed (vLLM, SGLang, LMCache in their venvs) passes."""
    for engine in compat.TESTED:
        compat.require(engine)


def test_docs_table_lists_every_tested_series():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "compatibility.md").read_text()
    for engine, (_, tested) in compat.TESTED.items():
        for s in tested:
            assert f"{s}.x" in text, (engine, s)
