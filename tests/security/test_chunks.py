"""Authenticated chunks (issue 13), attacked through real pools: a real `kvpool serve` with a
keyring, a real `kvpool serve` without one, and an embedded pool whose DRAM tier the test writes
into directly (the raw one-byte write an unauthenticated data plane used to allow).

The victim is what a reference worker of tenant `acme` runs: a `ChunkStore` in acme's namespace
(salted with `tenant_salt`), on a pool client authenticated as acme, MACing under acme's chunk
key. The attacker writes into acme's key space without acme's secret: `acme-intern`, a second
principal of tenant acme with a secret of its own (the pool lets it read and write acme's keys;
only the chunk MAC tells its objects apart). Each attack must give the victim a miss (never the
attacker's bytes) and must not make the victim's reader delete anything, while the victim's own
chunks still load.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import numpy as np
import pytest

import kvpool
from engine_adapters.chunk_store import ChunkStore
from kvpool.security.keyring import chunk_mac_key, tenant_salt
from kvpool.chunk_format import HEADER_SIZE, ChunkAuth, KVLayout, encode_chunk
from kvpool.errors import AlreadyExists
from kvpool.keys import Namespace
from kvpool.security.keyring import Credential
from pool_auth_support import ROLES, SECRETS
from served_support import Serve

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype="float32", chunk_tokens=16)
BASE = Namespace("security-model", "w" * 32, LAYOUT)
ATTACKER = "acme-intern"
SECRETS = {**SECRETS, ATTACKER: "i" * 40}
ROLES = {**ROLES, ATTACKER: "tenant:acme"}


def cred(name: str) -> Credential:
    return Credential(name, SECRETS[name].encode())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chunks-keyring")
    keyring = tmp / "keyring.toml"
    keyring.write_text("".join(f'[principals.{n}]\nrole = "{ROLES[n]}"\nsecret = "{s}"\n' for n, s in SECRETS.items()))
    os.chmod(keyring, 0o600)
    pool = Serve(tmp / "serve.log", keyring, None, "--dram-capacity", "64MiB")
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="module")
def open_pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chunks-open")
    pool = Serve(tmp / "serve.log", None, None, "--dram-capacity", "64MiB")
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def clients():
    made = []

    def connect(address: str, name: str | None = None):
        client = kvpool.connect(address, credential=cred(name) if name else None)
        made.append(client)
        return client

    yield connect
    for client in made:
        client.close()


def tenant_store(pool, tenant: str, keyed: bool = True, salt: str | None = None) -> ChunkStore:
    """What a worker of `tenant` uses: its salted namespace and, keyed, its chunk MAC key."""
    secret = SECRETS[tenant].encode()
    ns = replace(BASE, tenant_salt=salt if salt is not None else tenant_salt(tenant, secret))
    return ChunkStore(pool, ns, mac_key=chunk_mac_key(secret) if keyed else None)


def prompt(seed: int, chunks: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, chunks * LAYOUT.chunk_tokens).tolist()


def kv_of(key: str) -> np.ndarray:
    """The KV a victim computes for a chunk (deterministic per key, never all zeros)."""
    rng = np.random.default_rng(int(key[:8], 16))
    return rng.standard_normal(LAYOUT.shape(LAYOUT.chunk_tokens)).astype(np.float32) + 10


def save(store: ChunkStore, ids: list[int]) -> list[str]:
    """The worker's write path: plan (skips keys the pool has), fill payloads, seal and put."""
    keys, planned, _ = store.plan_save(ids)
    for obj in planned:
        payload = kv_of(obj.key).tobytes()
        obj.buffer[HEADER_SIZE:HEADER_SIZE + len(payload)] = payload
    store.store(keys, planned, None, len(ids))
    return keys


def loaded(store: ChunkStore, ids: list[int]) -> list[np.ndarray]:
    return [view.as_numpy() for view in store.fetch_prefix(ids)]


def put(client, key: str, blob) -> None:
    for _ in range(200):  # a remove completes once read leases end
        try:
            return client.put(key, bytes(blob))
        except AlreadyExists:
            time.sleep(0.01)
    raise AssertionError(f"could not put {key}")


def test_a_key_poisoned_first_is_a_miss_never_the_attackers_bytes(served, clients):
    victim = tenant_store(clients(served.address, "acme"), "acme")
    attacker = clients(served.address, ATTACKER)
    ids = prompt(1)
    keys = victim.chunk_keys(ids)
    poison = np.zeros(LAYOUT.shape(16), np.float32)
    # well formed and bound to the victim's namespace and key, but unkeyed / MACed under the attacker's key
    attacker.put(keys[1], bytes(encode_chunk(LAYOUT, poison, key=keys[1], auth=ChunkAuth(victim.auth.namespace))))
    wrong_key = ChunkAuth(victim.auth.namespace, chunk_mac_key(SECRETS[ATTACKER].encode()))
    attacker.put(keys[2], bytes(encode_chunk(LAYOUT, poison, key=keys[2], auth=wrong_key)))

    save(victim, ids)  # first writer wins: keys 1 and 2 stay the attacker's
    got = loaded(victim, ids)
    assert len(got) == 1 and np.array_equal(got[0], kv_of(keys[0])), "a miss from chunk 1 on"
    views = victim.reader.read(keys)
    assert [v is not None for v in views] == [True, False, False]
    assert victim.reader.rejected == 3 and victim.reader.fetched == 2
    assert attacker.exists_batch(keys[1:]) == [True, True], "the victim's reader deletes nothing"
    # the legitimate client is still served: an unpoisoned prompt loads whole
    other = prompt(2)
    save(victim, other)
    assert [np.array_equal(a, kv_of(k)) for a, k in zip(loaded(victim, other), victim.chunk_keys(other))] == [True] * 3


def test_a_valid_chunk_copied_under_another_key_is_a_miss(served, clients):
    victim = tenant_store(clients(served.address, "acme"), "acme")
    attacker = clients(served.address, ATTACKER)
    a, b = prompt(3), prompt(4)
    keys_a = save(victim, a)
    keys_b = victim.chunk_keys(b)
    attacker.put(keys_b[0], attacker.get(keys_a[0]))  # a genuine acme chunk, MAC and all, under B's first key
    assert loaded(victim, b) == []
    assert victim.reader.rejected == 1 and attacker.exists(keys_b[0])
    assert len(loaded(victim, a)) == 3


def test_a_one_byte_raw_write_is_a_miss_and_deletes_nothing():
    """On an embedded pool the test writes one byte straight into the DRAM tier (the raw data-plane
    write that used to be open to anyone); the keyed reader answers a miss and leaves the object.
    An unkeyed reader (no keyring: anyone may remove anyway) still removes its own damaged chunk."""
    from kvpool.config import load_settings
    from kvpool.embedded import EmbeddedPool

    with EmbeddedPool(load_settings(port=0, admin_port=0, dram_capacity=64 << 20)) as ep, \
            kvpool.connect(ep.address) as client:
        victim = tenant_store(client, "acme")
        ids = prompt(5)
        keys = save(victim, ids)
        for pos in (HEADER_SIZE + 5, 48, 100):  # a payload byte, the namespace, the MAC tag
            ep.node.store.dram.view(keys[1])[pos] ^= 0x01
            assert len(loaded(victim, ids)) == 1
            ep.node.store.dram.view(keys[1])[pos] ^= 0x01
            assert len(loaded(victim, ids)) == 3
        ep.node.store.dram.view(keys[1])[HEADER_SIZE + 5] ^= 0x01
        assert len(loaded(victim, ids)) == 1 and client.exists(keys[1]) and victim.reader.rejected == 4

        plain = tenant_store(client, "beta", keyed=False)  # the unkeyed default heals its own damage
        keys = save(plain, ids)
        ep.node.store.dram.view(keys[1])[HEADER_SIZE + 5] ^= 0x01
        assert len(loaded(plain, ids)) == 1 and not client.exists(keys[1]) and plain.reader.rejected == 0


def test_another_tenants_chunk_is_a_miss(served, clients):
    victim = tenant_store(clients(served.address, "acme"), "acme")
    beta = tenant_store(clients(served.address, "beta"), "beta")
    attacker = clients(served.address, ATTACKER)
    ids = prompt(6)
    beta_keys = save(beta, ids)
    assert len(loaded(beta, ids)) == 3
    keys = victim.chunk_keys(ids)
    assert set(keys).isdisjoint(beta_keys), "tenants' salts keep their keys apart"
    # beta's genuine chunk, under acme's key (the pool scopes keys per tenant: planted by the attacker)
    attacker.put(keys[0], beta.pool.get(beta_keys[0]))
    assert loaded(victim, ids) == [] and attacker.exists(keys[0])
    assert victim.lookup(ids) == LAYOUT.chunk_tokens, "the pool holds it; the reader refuses it"


def test_without_a_keyring_chunks_are_still_bound_to_namespace_and_key(open_pool, clients):
    """The default (no keyring): two tenants told apart only by their salt share one flat pool. A
    chunk of the other tenant, or of another key, planted under a key is a miss, and the reader
    does not remove it (only its own damaged chunks)."""
    pool = clients(open_pool.address)
    acme = tenant_store(pool, "acme", keyed=False, salt="acme-salt")
    beta = tenant_store(pool, "beta", keyed=False, salt="beta-salt")
    ids, other = prompt(7), prompt(8)
    beta_keys, acme_keys = save(beta, ids), save(acme, other)
    keys = acme.chunk_keys(ids)
    put(pool, keys[0], pool.get(beta_keys[0]))  # another tenant's chunk
    put(pool, keys[1], pool.get(acme_keys[1]))  # acme's own chunk, copied under another key
    assert acme.reader.read(keys[:2]) == [None, None]
    assert acme.reader.rejected == 2 and pool.exists_batch(keys[:2]) == [True, True]
    assert len(loaded(acme, other)) == 3 and len(loaded(beta, ids)) == 3
