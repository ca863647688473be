"""The admin REST API over a real MasterService: every endpoint, and each kind of bad input
answered with a typed 4xx while the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

NODE = "node-a"  # the node record conftest.py registers


def _error(response, status, code):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["code"] == code and body["error"]["message"]
    assert "Traceback" not in response.text
    return body


def test_health_ready_and_openapi(admin):
    _, c = admin
    assert c.get("/health").json()["status"] == "ok"
    assert c.get("/ready").status_code == 200
    schema = c.get("/openapi.json").json()
    for path in ("/v1/nodes", "/v1/nodes/{node_id}", "/v1/nodes/{node_id}/drain", "/v1/stats", "/v1/evict",
                 "/v1/config", "/v1/keys/{key}", "/metrics", "/health", "/ready"):
        assert path in schema["paths"], path
    assert c.get("/docs").status_code == 200


def test_not_ready_without_nodes(master, open_admin):
    _, c = open_admin
    master.admin.remove_node(NODE)
    r = c.get("/ready")
    assert r.status_code == 503 and "no store node" in r.json()["detail"]
    assert c.get("/health").status_code == 200


def test_nodes_and_node(admin):
    _, c = admin
    nodes = c.get("/v1/nodes").json()["nodes"]
    assert [n["node_id"] for n in nodes] == [NODE]
    assert nodes[0]["capacity"] == {"dram": 64 << 20} and nodes[0]["used_bytes"] == 6000
    node = c.get(f"/v1/nodes/{NODE}").json()["node"]
    assert node["objects"] == 3 and node["state"] == "up"


def test_stats_per_tier(admin):
    _, c = admin
    stats = c.get("/v1/stats").json()["stats"]
    assert stats["objects"] == 3
    assert stats["tiers"]["dram"]["capacity_bytes"] == 64 << 20
    assert stats["tiers"]["dram"]["used_bytes"] == 6000


def test_key_info(admin):
    _, c = admin
    info = c.get("/v1/keys/key-1").json()["info"]
    assert info["size"] == 2000 and info["state"] == "complete"
    assert [r["node_id"] for r in info["replicas"]] == [NODE]
    assert "lease" in info


def test_unknown_key_and_malformed_key(admin):
    _, c = admin
    _error(c.get("/v1/keys/tail/no-such-request"), 404, "not_found")
    _error(c.get("/v1/keys/" + "k" * 600), 400, "invalid_argument")
    assert c.get("/v1/keys/key-0").status_code == 200  # still serving


def test_unknown_node(admin, auth):
    _, c = admin
    _error(c.get("/v1/nodes/no-such-node"), 404, "not_found")
    _error(c.post("/v1/nodes/no-such-node/drain", headers=auth), 404, "not_found")
    _error(c.delete("/v1/nodes/no-such-node", headers=auth), 404, "not_found")
    assert c.get("/v1/nodes").status_code == 200


def test_drain_and_remove(master, admin, auth):
    _, c = admin
    r = c.post(f"/v1/nodes/{NODE}/drain", headers=auth)
    assert r.status_code == 200 and r.json()["result"]["state"] == "draining"
    assert master.admin.node(NODE)["state"] == "draining"
    r = c.delete(f"/v1/nodes/{NODE}", headers=auth)
    assert r.status_code == 200
    assert c.get("/v1/nodes").json()["nodes"] == []
    _error(c.get("/v1/keys/key-0"), 404, "not_found")  # its replicas left the index


BAD_AUTH = [None, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"},
            {"Authorization": "Bearer  x y"}, {"Authorization": "Token abc"}, {"Authorization": "bearer"}]


@pytest.mark.parametrize("method,path,body", [
    ("POST", f"/v1/nodes/{NODE}/drain", None),
    ("DELETE", f"/v1/nodes/{NODE}", None),
    ("POST", "/v1/evict", {"target_bytes": 1}),
    ("PATCH", "/v1/config", {"lease_s": 3.0}),
    ("GET", "/v1/keys", None),  # reads too (issue 13): keys name tenants' prompts
    ("GET", "/v1/config", None),
    ("GET", "/v1/stats", None),
    ("GET", "/metrics", None),
])
def test_every_endpoint_needs_the_token(master, admin, method, path, body):
    handle, _ = admin
    with httpx.Client(base_url=handle.url, timeout=10) as c:  # presents no token by default
        for headers in BAD_AUTH:
            r = c.request(method, path, json=body, headers=headers)
            body_doc = _error(r, 401, "unauthorized")
            assert set(body_doc) == {"version", "error"}  # never data
            assert r.headers.get("www-authenticate") == "Bearer"
            # nothing happened
            assert master.admin.node(NODE)["state"] == "up"
            assert master.admin.stats()["objects"] == 3
            assert master.admin.config()["lease_s"] == 10.0
        for path in ("/health", "/ready", "/openapi.json"):  # probes and the schema stay open
            assert c.get(path).status_code == 200


def test_authentication_off_means_open(master, open_admin):
    _, c = open_admin
    assert c.post(f"/v1/nodes/{NODE}/drain").status_code == 200


def test_no_token_configured_means_the_users_own(master):
    """Issue 27: with no configuration the admin API takes its user's own token (made on first use,
    0600, `kvpool.security.local`): another local user, who cannot read it, is refused."""
    import httpx

    from kvpool.admin import create_app, serve_in_thread
    from kvpool.config import Settings
    from kvpool.security.local import local_dir, local_token

    handle = serve_in_thread(create_app(master.admin, Settings()), "127.0.0.1", 0)
    try:
        with httpx.Client(base_url=handle.url, timeout=10) as c:
            assert c.post(f"/v1/nodes/{NODE}/drain").status_code == 401
            assert c.get("/v1/keys").status_code == 401
            own = {"Authorization": f"Bearer {local_token('admin')}"}
            assert c.get("/v1/keys", headers=own).status_code == 200
            assert c.get("/metrics", headers={"Authorization": f"Bearer {local_token('metrics')}"}).status_code == 200
        assert (local_dir() / "admin.token").stat().st_mode & 0o777 == 0o600
    finally:
        handle.stop()


def test_evict_by_keys_and_bytes(master, admin, auth):
    _, c = admin
    r = c.post("/v1/evict", json={"version": 1, "keys": ["key-0", "absent"]}, headers=auth)
    assert r.status_code == 200 and r.json()["result"]["evicted"] == 1
    assert not master.exists(["key-0"])[0]
    r = c.post("/v1/evict", json={"target_bytes": 2500}, headers=auth)
    assert r.json()["result"]["evicted"] >= 1 and r.json()["result"]["freed_bytes"] >= 2500
    assert master.admin.stats()["objects"] <= 1


@pytest.mark.parametrize("content,ctype", [
    (b"{not json", "application/json"),
    (b"[1, 2]", "application/json"),
    (b'{"target_bytes": 1, "keys": ["a"]}', "application/json"),
    (b"{}", "application/json"),
    (b'{"target_bytes": -5}', "application/json"),
    (b'{"target_bytes": "lots"}', "application/json"),
    (b'{"keys": ["' + b"x" * 600 + b'"]}', "application/json"),
    (b'{"target_bytes": 1, "version": 9}', "application/json"),
    (b'{"target_bytes": 1, "surprise": true}', "application/json"),
])
def test_evict_bad_body(master, admin, auth, content, ctype):
    _, c = admin
    r = c.post("/v1/evict", content=content, headers={**auth, "Content-Type": ctype})
    _error(r, 400, "invalid_argument")
    assert master.admin.stats()["objects"] == 3
    assert c.get("/health").status_code == 200


def test_malformed_json_message_says_so(admin, auth):
    _, c = admin
    r = c.post("/v1/evict", content=b"{oops", headers={**auth, "Content-Type": "application/json"})
    assert "JSON" in r.json()["error"]["message"]


def test_config_get_and_patch(master, admin, auth):
    _, c = admin
    cfg = c.get("/v1/config").json()["config"]
    assert cfg["lease_s"] == 10.0 and "admin_token" not in cfg or cfg.get("admin_token") in (None, "***")
    r = c.patch("/v1/config", json={"lease_s": 4.5, "replicas": 2}, headers=auth)
    assert r.status_code == 200 and r.json()["config"]["lease_s"] == 4.5
    assert master.state.tunables.lease_s == 4.5 and master.replicas == 2


@pytest.mark.parametrize("body", [
    b'{"lease_s": -1}', b'{"port": 1}', b'{"no_such_setting": 1}', b"{}", b"[]", b"{nope",
    b'{"admin_token": "mine"}', b'{"replicas": "two"}',
])
def test_config_patch_bad_input(master, admin, auth, body):
    _, c = admin
    r = c.patch("/v1/config", content=body, headers={**auth, "Content-Type": "application/json"})
    _error(r, 400, "invalid_argument")
    assert master.state.tunables.lease_s == 10.0 and master.replicas == 1


def test_secret_never_returned(master, admin):
    master.state.settings.security.admin_token = "leak-me"  # even if the master forgot to drop it
    _, c = admin
    assert "leak-me" not in c.get("/v1/config").text


def test_unknown_route_and_method(admin):
    _, c = admin
    _error(c.get("/v1/nope"), 404, "not_found")
    _error(c.put("/v1/stats"), 405, "method_not_allowed")


def test_unexpected_master_error_is_a_500_without_traceback(master, admin, monkeypatch):
    _, c = admin

    def broken():
        raise RuntimeError("boom in the master")

    monkeypatch.setattr(master.admin, "key_info", lambda key: broken())
    r = c.get("/v1/keys/key-0")
    _error(r, 500, "internal")
    assert "boom" not in r.text
    assert c.get("/v1/stats").status_code == 200  # same keep-alive connection, still served


def test_stop_is_idempotent_and_frees_the_port(master):
    import socket

    from kvpool.admin import create_app, serve_in_thread
    from kvpool.config import Settings

    handle = serve_in_thread(create_app(master.admin, Settings()), "127.0.0.1", 0)
    port = handle.port
    handle.stop()
    handle.stop()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_port_in_use_is_a_typed_error(master):
    import socket

    from kvpool.admin import create_app, serve_in_thread
    from kvpool.config import Settings
    from kvpool.errors import Unavailable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(Unavailable, match="cannot listen"):
            serve_in_thread(create_app(master.admin, Settings()), "127.0.0.1", s.getsockname()[1])


def test_list_keys(admin):
    _, c = admin
    assert sorted(c.get("/v1/keys").json()["keys"]) == ["key-0", "key-1", "key-2"]
    assert c.get("/v1/keys", params={"prefix": "key-1"}).json()["keys"] == ["key-1"]
    assert len(c.get("/v1/keys", params={"limit": 2}).json()["keys"]) == 2
    _error(c.get("/v1/keys", params={"limit": 0}), 400, "invalid_argument")
    _error(c.get("/v1/keys", params={"limit": "many"}), 400, "invalid_argument")


def test_undrain(master, admin, auth):
    _, c = admin
    c.post(f"/v1/nodes/{NODE}/drain", headers=auth)
    r = c.post(f"/v1/nodes/{NODE}/undrain", headers=auth)
    assert r.status_code == 200 and master.admin.node(NODE)["state"] == "up"
    _error(c.post(f"/v1/nodes/{NODE}/undrain", headers={"Authorization": "Bearer other"}), 401, "unauthorized")


def test_async_master_methods_are_awaited(master):
    """A master whose methods are coroutines (an asyncio master) works the same."""
    import httpx

    from kvpool.admin import create_app, serve_in_thread
    from kvpool.config import Settings

    class AsyncFacade:
        def __getattr__(self, name):
            target = getattr(master.admin, name)

            async def call(*args, **kwargs):
                return target(*args, **kwargs)

            return call

    handle = serve_in_thread(create_app(AsyncFacade(), Settings(admin_token="t" * 20)), "127.0.0.1", 0)
    try:
        with httpx.Client(base_url=handle.url, timeout=10, headers={"Authorization": "Bearer " + "t" * 20}) as c:
            assert c.get("/v1/stats").json()["stats"]["objects"] == 3
            assert c.get("/v1/keys/key-2").json()["info"]["size"] == 3000
            assert c.get("/v1/nodes/ghost").status_code == 404
            assert c.get("/ready").status_code == 200
            assert "kvpool_pool_objects" in c.get("/metrics").text
    finally:
        handle.stop()
