"""Bearer-token rule of the admin API.

Invariants: when a token is configured (`admin_token`, `KVPOOL_ADMIN_TOKEN`, or the file named
by `admin_token_file` / `KVPOOL_ADMIN_TOKEN_FILE`), every request without `Authorization: Bearer
<token>`, or with any other token, is answered 401 before any handler runs (so it never reaches
the master and never returns data), except the paths in `OPEN_PATHS`:

- `/health`, `/ready`: liveness and readiness probes, which cannot present a secret; they say
  "ok" or why not (a standby master names its leader's address), nothing of the pool's keys.
- `/openapi.json`, `/docs`, `/docs/oauth2-redirect`, `/redoc`: the API's shape, which is public
  (it is this source tree's).

`/metrics` needs the token too: it carries per-node addresses and usage, and Prometheus presents a
bearer token from a file (`authorization: {credentials_file: ...}` in its scrape config).
With no token configured, every request passes (the default on loopback; protected mode refuses a
non-loopback admin bind without a token). Tokens are compared in constant time
(`kvpool.http_guard.HttpGuard`, which the app installs with `needs_token`).
"""

from __future__ import annotations

OPEN_PATHS = frozenset({"/health", "/ready", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def needs_token(path: str) -> bool:
    return path not in OPEN_PATHS
