"""Who is asking the admin API: the admin (bearer token), a tenant (its derived token), or nobody.

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
non-loopback admin bind without a token).

Tenants: with a keyring (`auth_file`), a tenant principal may present its own token,
`kvpool.security.keyring.admin_api_token(secret)` (derived: the secret never goes on the wire).
Its request is marked `request.state.tenant = <id>` and may reach only the routes
`TenantTokens.refusal` allows (its keys, one key, its use and quota), which the app scopes to its
keys; anything else is answered 403 before any handler runs, so a new endpoint is closed to
tenants until it is listed here. A tenant token is honoured with or without an admin token
configured (without one, a request with no token still gets the whole view, as before). The admin
token keeps full access. Tokens are compared in constant time, every tenant's each time.
"""

from __future__ import annotations

from kvpool.security.keyring import Keyring, admin_api_token
from kvpool.security.http_guard import same_token

OPEN_PATHS = frozenset({"/health", "/ready", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def needs_token(path: str) -> bool:
    return path not in OPEN_PATHS


class TenantTokens:
    """The admin API's tenants for `kvpool.security.http_guard.HttpGuard`: the keyring's tenant
    principals by their admin-API token; a tenant may ask only `GET /v1/keys`, `GET /v1/keys/{key}`
    and `GET /v1/stats`."""

    def __init__(self, keyring: Keyring | None):
        entries = keyring.entries.values() if keyring is not None else ()
        self.tenants = [(admin_api_token(e.secret), e.principal.tenant)
                        for e in entries if e.principal.tenant]

    def __bool__(self) -> bool:
        return bool(self.tenants)

    def tenant_of(self, presented: str) -> str | None:
        found = None
        for token, tenant in self.tenants:  # no early exit: the time does not say which tenant matched
            if same_token(presented, token):
                found = tenant
        return found

    def refusal(self, method: str, path: str, tenant: str) -> str | None:
        if method in ("GET", "HEAD") and (path in ("/v1/keys", "/v1/stats") or path.startswith("/v1/keys/")):
            return None
        return (f"tenant {tenant!r} may read only its own keys and use (GET /v1/keys, /v1/keys/{{key}}, "
                "/v1/stats); this needs the admin token")
