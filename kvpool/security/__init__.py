"""Who is asking, and what they may touch: the one place for authentication and tenancy.

    keyring      principals, their secrets and quotas (the keyring file), handshake proofs
    local        the per-user keyring and tokens used when nothing is configured (shared hosts)
    tenancy      a stored key's tenant ("<tenant>\\x00<key>") and how keys are scoped
    authz        what a principal may do over the RPC (scoping, admin-only calls)
    tickets      the master's signed word that a node may take one write (cluster quotas)
    admin_token  the admin API's bearer token
    http_guard   the HTTP side: internal headers between router and workers, tenant API keys

The transfer engine authenticates its own port (`transfer.auth`): it imports nothing of ours.
"""
