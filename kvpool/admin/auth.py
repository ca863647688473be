"""Bearer-token check for the admin API.

Invariants: when a token is configured, a mutating request without `Authorization: Bearer
<token>` or with any other token is answered 401 before the handler runs, so it never reaches
the master and never returns data. A read request may omit the header; one that presents a
wrong token is also refused (a client holding a wrong secret should learn it). With no token
configured, every request passes. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from typing import Callable

from fastapi import Request

from kvpool.errors import Unauthorized


def _presented(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized("Authorization header must be 'Bearer <token>'")
    return value.strip()


def _matches(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode(), expected.encode())


def token_guard(get_token: Callable[[], str | None], *, mutating: bool) -> Callable[[Request], None]:
    """A FastAPI dependency enforcing the rules above; `get_token` is read per request so a
    token changed through the config takes effect at once."""

    def guard(request: Request) -> None:
        expected = get_token()
        if not expected:
            return
        presented = _presented(request)
        if presented is None:
            if mutating:
                raise Unauthorized("this endpoint requires a bearer token (Authorization: Bearer <token>)")
            return
        if not _matches(presented, expected):
            raise Unauthorized("wrong bearer token")

    return guard
