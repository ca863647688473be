"""deploy/ checked statically (issue 14): the Kubernetes manifests against the API schemas
(`kubernetes-validate`, strict) and a security check (`checkov`, plus the rules below, which
always run); the compose file against the compose specification's JSON schema and through
`podman-compose config`; the Dockerfile's user. No image is built and no container runs here.

Accepted findings, each annotated in the manifest it concerns: images are pinned by tag, not
digest (kvpool:local is built on the machines, no registry), and pulled IfNotPresent; the single
etcd member's peer URL is on loopback (no peer TLS).

Secure by default (issue 13): every service that listens beyond loopback has the keyring
(protected mode would refuse it otherwise), secrets are files from Secret volumes (never
environment values or argv), etcd speaks TLS and wants client certificates, and NetworkPolicies
deny every ingress but the router's and the pods' own.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
COMPOSE = DEPLOY / "docker-compose.yml"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
CHECKOV_SKIPS: list[str] = []


def _docs():
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def test_there_are_manifests():
    kinds = {doc["kind"] for _, doc in _docs()}
    assert {"Namespace", "StatefulSet", "Deployment", "Service"} <= kinds, kinds


# ---- schema validation -----------------------------------------------------------------------

def test_manifests_match_the_kubernetes_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[dev]')")
    version = kv.latest_version() if hasattr(kv, "latest_version") else "1.37.0"
    problems = []
    for name, doc in _docs():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            problems.append(f"{name} {doc['kind']}/{doc['metadata'].get('name')}: {exc.message} at {list(exc.path)}")
    assert not problems, "\n".join(problems)


def test_schema_validation_catches_a_broken_manifest():
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    doc = next(d for _, d in _docs() if d["kind"] == "Deployment")
    broken = json.loads(json.dumps(doc))
    broken["spec"]["replicas"] = "two"
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy2"] = "x"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, "1.37.0", strict=True)


# ---- security rules (ours: always run) -------------------------------------------------------

def security_findings(name: str, doc: dict) -> list[str]:
    """What a workload manifest gets wrong: namespace, pod/container security contexts, service
    account token, resources, probes, host namespaces, and writable paths."""
    if doc.get("kind") not in WORKLOADS:
        return []
    where = f"{name} {doc['kind']}/{doc['metadata']['name']}"
    out = []
    if doc["metadata"].get("namespace", "default") == "default":
        out.append(f"{where}: in the default namespace")
    pod = doc["spec"]["template"]["spec"]
    psc = pod.get("securityContext") or {}
    for flag in ("hostIPC", "hostPID", "hostNetwork"):
        if pod.get(flag):
            out.append(f"{where}: {flag} is set")
    if pod.get("automountServiceAccountToken") is not False:
        out.append(f"{where}: mounts a service account token it does not use")
    if (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        out.append(f"{where}: no RuntimeDefault seccomp profile")
    mounts_allowed = {v["name"] for v in pod.get("volumes", [])} | {
        t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
    for c in pod["containers"] + pod.get("initContainers", []):
        cw = f"{where} container {c['name']}"
        sc = c.get("securityContext") or {}
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            out.append(f"{cw}: may run as root")
        uid = sc.get("runAsUser", psc.get("runAsUser"))
        if uid is None or uid < 10000:
            out.append(f"{cw}: no high runAsUser ({uid})")
        if sc.get("privileged"):
            out.append(f"{cw}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{cw}: allows privilege escalation")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{cw}: writable root filesystem")
        if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
            out.append(f"{cw}: keeps default capabilities")
        if (sc.get("capabilities") or {}).get("add"):
            out.append(f"{cw}: adds capabilities {sc['capabilities']['add']}")
        res = c.get("resources") or {}
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                if r not in (res.get(kind) or {}):
                    out.append(f"{cw}: no {r} {kind[:-1]}")
        for probe in ("livenessProbe", "readinessProbe"):
            if probe not in c and c in pod["containers"]:  # init containers may not have probes
                out.append(f"{cw}: no {probe}")
        for m in c.get("volumeMounts", []):
            if m["name"] not in mounts_allowed:
                out.append(f"{cw}: mounts unknown volume {m['name']}")
        paths = {m["mountPath"] for m in c.get("volumeMounts", [])}
        if c.get("image", "").startswith("kvpool:") and "/tmp" not in paths and c in pod["containers"]:
            out.append(f"{cw}: read-only root but no writable /tmp")
    return out


def test_workloads_pass_the_security_rules():
    problems = [p for name, doc in _docs() for p in security_findings(name, doc)]
    assert not problems, "\n".join(problems)


def _containers():
    for name, doc in _docs():
        if doc["kind"] in WORKLOADS:
            pod = doc["spec"]["template"]["spec"]
            for c in pod["containers"]:
                yield f"{name} {doc['metadata']['name']}/{c['name']}", doc, pod, c


def test_public_listeners_have_the_keyring_and_secrets_are_files():
    for where, doc, pod, c in _containers():
        argv = c.get("command", []) + c.get("args", [])
        env = {e["name"]: e for e in c.get("env", [])}
        assert not any("secretKeyRef" in (e.get("valueFrom") or {}) for e in env.values()), f"{where}: secret in env"
        on_argv = [a for a in argv if re.fullmatch(r"--[\w-]*(token|secret|password|salt)(=.*)?", a, re.I)]
        assert not on_argv, f"{where}: a secret on argv (ps shows it): {on_argv}"
        if not c["image"].startswith("kvpool:"):
            continue
        host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
        if host not in ("127.0.0.1", "localhost"):  # protected mode: the keyring, from a mounted file
            path = env.get("KVPOOL_AUTH_FILE", {}).get("value", "")
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            assert path and any(path.startswith(m + "/") for m in mounts), f"{where}: listens on {host} without a keyring"
        if "--admin-port" in argv:
            assert "KVPOOL_ADMIN_TOKEN_FILE" in env, f"{where}: an admin API without a token"
        if "--meta" in argv:
            meta = argv[argv.index("--meta") + 1]
            assert meta.startswith("etcds://") and {"KVPOOL_ETCD_CERT_FILE", "KVPOOL_ETCD_KEY_FILE"} <= set(env), where


def test_metrics_need_the_metrics_token_and_the_scraper_holds_only_it():
    """Issue 27: with a keyring a node's /metrics needs the metrics token (it refuses to start
    without one), and Prometheus scrapes with that token alone (no keyring, no admin or internal token)."""
    for where, doc, pod, c in _containers():
        env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
        mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
        if c["image"].startswith("kvpool:") and "KVPOOL_AUTH_FILE" in env:
            path = env.get("KVPOOL_METRICS_TOKEN_FILE", "")
            assert path and any(path.startswith(m + "/") for m in mounts), f"{where}: /metrics without the metrics token"
        if "prometheus" in c["image"]:
            secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
            assert secrets == {"kvpool-metrics"}, f"{where}: the scraper holds {secrets}"
    config = next(d for _, d in _docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvpool-prometheus")
    jobs = yaml.safe_load(config["data"]["prometheus.yml"])["scrape_configs"]
    assert {j["job_name"] for j in jobs} == {"kvpool-master", "kvpool-node", "kvpool-router", "kvpool-prefill",
                                             "kvpool-decode"}
    assert all(j["authorization"] == {"type": "Bearer", "credentials_file": "/secrets/metrics/metrics.token"}
               for j in jobs)


def test_compose_metrics_need_the_metrics_token_and_the_scraper_holds_only_it():
    doc = yaml.safe_load(COMPOSE.read_text())
    for name, svc in doc["services"].items():
        env = svc.get("environment") or {}
        if "KVPOOL_AUTH_FILE" in env:
            assert env.get("KVPOOL_METRICS_TOKEN_FILE") == "/run/secrets/metrics_token", name
            assert "metrics_token" in svc["secrets"], name
    prometheus = doc["services"]["prometheus"]
    assert prometheus["secrets"] == ["metrics_token"] and prometheus["profiles"] == ["monitoring"]
    jobs = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    assert all(j["authorization"]["credentials_file"] == "/run/secrets/metrics_token" for j in jobs)
    targets = {t for j in jobs for sc in j["static_configs"] for t in sc["targets"]}
    assert {f"{n}:{p}" for n, p in (("master-a", 7680), ("node-a", 7680), ("router", 8000),
                                     ("prefill", 8100))} <= targets


# which Secrets (and which of their keys) each workload may mount: only what its role uses
ROLE_SECRETS = {
    "kvpool-master": {"kvpool-auth": {"keyring.toml", "admin.token"}, "kvpool-etcd-tls": None, "kvpool-metrics": None},
    "kvpool-node": {"kvpool-auth": {"keyring.toml"}, "kvpool-etcd-tls": None, "kvpool-metrics": None},
    "kvpool-router": {"kvpool-router": {"keyring.toml", "internal.token"}, "kvpool-metrics": None},
    "kvpool-prefill": {"kvpool-workers": {"keyring.toml", "internal.token"}, "kvpool-metrics": None},
    "kvpool-decode": {"kvpool-workers": {"keyring.toml", "internal.token"}, "kvpool-metrics": None},
    "kvpool-etcd": {"kvpool-etcd-tls": None},
    "kvpool-prometheus": {"kvpool-metrics": None},
    "kvpool-grafana": {},  # reads Prometheus only: no credential of the pool
}


def test_each_role_holds_only_its_credentials():
    """Issue 27: every pod held the whole keyring. Now the node secret (kvpool-auth) is mounted by
    masters and nodes only; the router and workers hold their tenants' keyring and the internal
    token, and speak to the pool as their tenants (no KVPOOL_PRINCIPAL=node)."""
    for name, doc in _docs():
        if doc["kind"] not in WORKLOADS:
            continue
        app = doc["spec"]["template"]["metadata"]["labels"]["app"]
        allowed = ROLE_SECRETS[app]
        for vol in doc["spec"]["template"]["spec"].get("volumes", []):
            if "secret" not in vol:
                continue
            secret = vol["secret"]["secretName"]
            assert secret in allowed, f"{name} {app}: mounts {secret}"
            keys = {item["key"] for item in vol["secret"].get("items", [])}
            assert allowed[secret] is None or keys <= allowed[secret], f"{name} {app}: {secret} keys {keys}"
        if app in ("kvpool-router", "kvpool-prefill", "kvpool-decode"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                assert env.get("KVPOOL_PRINCIPAL") != "node", f"{name} {app}: speaks as the node principal"
                assert env.get("KVPOOL_INTERNAL_TOKEN_FILE", "").startswith("/run/kvpool/"), f"{name} {app}"


def test_etcd_wants_tls_client_certificates():
    (where, _, _, c), = [x for x in _containers() if x[3]["name"] == "etcd"]
    argv = " ".join(c.get("command", []) + c.get("args", []))
    for flag in ("--client-cert-auth=true", "--trusted-ca-file=", "--cert-file=", "--key-file=",
                 "--listen-client-urls=https://"):
        assert flag in argv, (where, flag)
    assert "http://0.0.0.0:2379" not in argv


def test_network_policies_deny_by_default_and_expose_only_the_router():
    policies = [d for _, d in _docs() if d["kind"] == "NetworkPolicy"]
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")]
    assert deny and "Ingress" in deny[0]["spec"]["policyTypes"]
    open_to_all = [p["spec"]["podSelector"] for p in policies
                   for rule in p["spec"].get("ingress", []) if not rule.get("from")]
    assert open_to_all == [{"matchLabels": {"app": "kvpool-router"}}], open_to_all
    apps = {d["spec"]["template"]["metadata"]["labels"]["app"] for _, d in _docs() if d["kind"] in WORKLOADS}
    covered = set()
    for p in policies:
        sel = p["spec"]["podSelector"]
        covered |= set(sel.get("matchLabels", {}).values())
        for e in sel.get("matchExpressions", []):
            covered |= set(e["values"])
    assert apps <= covered, apps - covered  # each workload has its own rule besides the default deny


def test_security_rules_catch_a_bad_workload():
    doc = json.loads(json.dumps(next(d for _, d in _docs() if d["kind"] == "StatefulSet")))
    pod = doc["spec"]["template"]["spec"]
    pod["hostIPC"] = True
    c = pod["containers"][0]
    c["securityContext"] = {"privileged": True}
    del c["resources"]["limits"]
    found = "\n".join(security_findings("bad.yaml", doc))
    for expected in ("hostIPC", "privileged", "privilege escalation", "writable root", "no cpu limit", "no memory limit"):
        assert expected in found, (expected, found)


CHECKOV_VENV = Path.home() / ".cache" / "kvpool" / "checkov-venv"


def _checkov() -> str | None:
    for candidate in (ROOT / ".venv" / "bin" / "checkov", CHECKOV_VENV / "bin" / "checkov"):
        if candidate.exists():
            return str(candidate)
    return shutil.which("checkov")


def test_checkov_finds_nothing_unaccepted():
    checkov = _checkov()
    if checkov is None:
        pytest.skip(f"checkov is not installed: it pins old versions of packages .venv uses (packaging, ...), so it "
                    f"lives in a venv of its own: python3 -m venv {CHECKOV_VENV} && {CHECKOV_VENV}/bin/pip install checkov")
    r = subprocess.run([checkov, "-d", str(DEPLOY), "--framework", "kubernetes", "dockerfile", "--skip-check",
                        ",".join(CHECKOV_SKIPS), "--quiet", "--compact", "-o", "json"],
                       capture_output=True, text=True, timeout=240)
    assert r.stdout.strip(), r.stderr[-2000:]
    reports = json.loads(r.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    frameworks = {rep["check_type"] for rep in reports}
    assert {"kubernetes", "dockerfile"} <= frameworks, frameworks
    failed = [f"{rep['check_type']}: {f['check_id']} {f['check_name']} ({f['resource']}, {f['file_path']})"
              for rep in reports for f in rep["results"]["failed_checks"]]
    assert not failed, "\n".join(failed)
    assert all(rep["summary"]["passed"] > 0 for rep in reports)


# ---- docker-compose.yml and the Dockerfile ---------------------------------------------------

def _compose_schema() -> Path | None:
    """The compose specification's JSON schema as docker-compose (v1, Debian's package or PyPI's)
    ships it."""
    candidates = [Path("/usr/lib/python3/dist-packages/compose/config/compose_spec.json")]
    try:
        import compose.config  # type: ignore[import-not-found]

        candidates.insert(0, Path(compose.config.__file__).with_name("compose_spec.json"))
    except ImportError:
        pass
    return next((p for p in candidates if p.exists()), None)


def test_compose_file_matches_the_compose_spec():
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (kubernetes-validate brings it)")
    schema_path = _compose_schema()
    if schema_path is None:
        pytest.skip("the compose-spec JSON schema was not found: `apt-get install docker-compose` ships it "
                    "(compose/config/compose_spec.json)")
    validator = jsonschema.Draft7Validator(json.loads(schema_path.read_text()))
    doc = yaml.safe_load(COMPOSE.read_text())
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, "\n".join(errors)
    # and the schema is strict enough to notice a typo
    doc["services"]["router"]["ipcc"] = "host"
    assert list(validator.iter_errors(doc))


def test_compose_file_parses_with_podman_compose():
    exe = Path(sys.executable).with_name("podman-compose")
    if not exe.exists():
        pytest.skip("podman-compose is not installed (pip install -e '.[dev]')")
    r = subprocess.run([str(exe), "--dry-run", "-f", str(COMPOSE), "config"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    services = yaml.safe_load(r.stdout)["services"]
    assert set(services) == {"etcd", "master-a", "master-b", "node-a", "node-b", "prefill", "decode", "router"}
    # the YAML anchors were merged: master-b is master-a with its own published port
    assert services["master-b"]["command"] == services["master-a"]["command"]
    published = [p for svc in services.values() for p in svc.get("ports", [])]
    assert published and all(str(p).startswith("127.0.0.1:") for p in published), published


def test_compose_services_are_hardened():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    problems = []
    for name, svc in services.items():
        if svc.get("ipc") == "host" or svc.get("pid") == "host" or svc.get("network_mode") == "host":
            problems.append(f"{name}: shares a host namespace")
        if svc.get("privileged"):
            problems.append(f"{name}: privileged")
        if svc.get("read_only") is not True:
            problems.append(f"{name}: writable root filesystem")
        if "ALL" not in (svc.get("cap_drop") or []) or svc.get("cap_add"):
            problems.append(f"{name}: keeps capabilities")
        if "no-new-privileges:true" not in (svc.get("security_opt") or []):
            problems.append(f"{name}: may gain privileges")
        if str(svc.get("user", "0")).split(":")[0] in ("0", "root"):
            problems.append(f"{name}: runs as root")
        if "mem_limit" not in svc:
            problems.append(f"{name}: no memory limit")
        if "healthcheck" not in svc:
            problems.append(f"{name}: no healthcheck")
    assert not problems, "\n".join(problems)


def _compose_services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]  # PyYAML merges the `<<` anchors


def test_compose_etcd_wants_tls_client_certificates():
    etcd = _compose_services()["etcd"]
    argv = etcd["command"]
    opt = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert opt["--listen-client-urls"].startswith("https://") and opt["--advertise-client-urls"] == "https://etcd:2379"
    assert "--client-cert-auth" in argv or "--client-cert-auth=true" in argv
    assert "--auto-tls" not in " ".join(argv)  # self-signed certificates would admit anyone
    mounted = {f"/run/secrets/{name}" for name in etcd["secrets"]}
    for flag in ("--cert-file", "--key-file", "--trusted-ca-file"):
        assert opt[flag] in mounted, (flag, opt[flag], mounted)
    assert "http://" not in opt["--listen-client-urls"] + opt["--advertise-client-urls"]
    # the peer URL stays on loopback: one member, no peer traffic to encrypt
    assert opt["--listen-peer-urls"].startswith("http://127.0.0.1:")
    # the healthcheck speaks TLS with a client certificate, from the mounted secrets
    check = etcd["healthcheck"]["test"]
    copt = {a: check[i + 1] for i, a in enumerate(check[:-1]) if a.startswith("--")}
    assert copt["--endpoints"].startswith("https://"), check
    assert {copt["--cacert"], copt["--cert"], copt["--key"]} <= mounted, check


def test_compose_reaches_etcd_only_over_tls_with_certificates_from_secrets():
    doc = yaml.safe_load(COMPOSE.read_text())
    secrets = doc["secrets"]
    assert not any("ca.key" in str(s.get("file", "")) for s in secrets.values()), "the CA's key is never mounted"
    users = 0
    for name, svc in doc["services"].items():
        argv = svc.get("command", [])
        # any etcd URL anywhere in the service (argv, environment, healthcheck) is etcds:// or https://
        text = json.dumps(svc)
        plain = re.findall(r"(?:etcd|http)://[^\s\",]*:2379", text)
        assert not plain, f"{name}: plain etcd URL {plain}"
        urls = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--meta", "--pool")]
        if not urls:
            continue
        users += 1
        assert all(u.startswith("etcds://") for u in urls), (name, urls)
        env, mounted = svc["environment"], {f"/run/secrets/{s}" for s in svc["secrets"]}
        for var in ("KVPOOL_ETCD_CA_FILE", "KVPOOL_ETCD_CERT_FILE", "KVPOOL_ETCD_KEY_FILE"):
            assert env.get(var) in mounted, f"{name}: {var}={env.get(var)!r} is not a mounted secret ({mounted})"
    assert users == 7, users  # masters, nodes, workers and the router all use etcd


def test_compose_roles_hold_only_their_credentials():
    services = _compose_services()
    for name, svc in services.items():
        secrets = set(svc.get("secrets") or [])
        env = svc.get("environment") or {}
        if name in ("router", "prefill", "decode"):
            assert "keyring" not in secrets and "admin_token" not in secrets, (name, secrets)
            assert env["KVPOOL_AUTH_FILE"] == "/run/secrets/tenants_keyring" and "KVPOOL_PRINCIPAL" not in env, name
            assert env["KVPOOL_INTERNAL_TOKEN_FILE"] == "/run/secrets/internal_token", name
        elif "keyring" in secrets:
            assert name.startswith(("master", "node")), name
        if "admin_token" in secrets:
            assert name.startswith("master"), name


def test_dockerfile_runs_as_an_unprivileged_user():
    lines = [ln.strip() for ln in (DEPLOY / "Dockerfile").read_text().splitlines()]
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    entry = max(i for i, ln in enumerate(lines) if ln.startswith("ENTRYPOINT"))
    assert max(i for i, ln in enumerate(lines) if ln.startswith("USER ")) < entry
