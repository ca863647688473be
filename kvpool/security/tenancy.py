"""Tenancy: a tenant's keys are stored scoped, "<tenant>\\x00<key>" (`kvpool.contract`); unscoped keys
(authentication off, admins, nodes) belong to tenant "". Every layer that needs a key's tenant
(eviction fairness, quotas, the admin API, the router) asks here."""

from __future__ import annotations

from kvpool.contract import SCOPE_SEP


def tenant_of(key: str) -> str:
    """The tenant a stored key belongs to ("<tenant>\\x00<key>", `kvpool.contract`); "" unscoped."""
    sep = key.find(SCOPE_SEP)
    return key[:sep] if sep > 0 else ""
