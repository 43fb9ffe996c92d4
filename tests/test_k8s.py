"""The Kubernetes manifests in docker/k8s/, validated offline against the Kubernetes API's
own schemas (kubernetes-validate ships them; strict: unknown fields are errors), and held to
what the server needs: probes on /readyz and /healthz, non-root, resources, the shared index
and blob store from a ConfigMap, secrets from a Secret."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import need

from megacache_server.settings import Settings

K8S = Path(__file__).resolve().parent.parent / "docker" / "k8s"
KUBERNETES_VERSION = "1.33.0"
"""A release kubernetes-validate (>= 1.30 in [dev]) carries the schemas of."""


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, Any]:
    """The one document of `kind` the server's Deployment is made of (the monitoring
    kit's ConfigMap of Prometheus rules aside: tests/test_alerts.py)."""
    [doc] = [d for d in documents() if d["kind"] == kind
             and d["metadata"]["name"] != "megacache-prometheus-rules"]
    return doc


def test_manifests_match_the_kubernetes_schemas():
    kv = need("kubernetes_validate", "pip install -e '.[dev]'")
    docs = documents()
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "Secret", "ConfigMap"}
    for doc in docs:
        kv.validate(doc, KUBERNETES_VERSION, strict=True)
    broken = {**by_kind("Deployment"), "spec": {**by_kind("Deployment")["spec"],
                                                 "replicas": "three"}}
    with pytest.raises(kv.ValidationError):  # the validator does check
        kv.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_deployment_probes_runs_unprivileged_and_reserves_resources():
    spec = by_kind("Deployment")["spec"]["template"]["spec"]
    [server] = spec["containers"]
    port = server["ports"][0]
    assert port["containerPort"] == Settings().port and port["name"] == "http"
    assert server["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert server["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 10001  # the image's USER
    assert server["securityContext"]["allowPrivilegeEscalation"] is False
    assert server["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(server["resources"]["requests"])
    assert "memory" in server["resources"]["limits"]
    service = by_kind("Service")
    assert service["spec"]["selector"] == by_kind("Deployment")["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_settings_come_from_the_configmap_and_the_secret():
    """Every variable the manifests set is a server setting (a typo would be ignored by the
    server: its settings ignore unknown variables), Redis and S3 are configured, and every
    secret the Deployment reads is in the Secret."""
    config = by_kind("ConfigMap")["data"]
    [server] = by_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    assert server["envFrom"] == [{"configMapRef": {"name": by_kind("ConfigMap")["metadata"]
                                                   ["name"]}}]
    names = set(config) | {e["name"] for e in server["env"]}
    known = {"MEGACACHE_" + f.upper() for f in Settings.model_fields}
    assert names <= known, names - known
    assert config["MEGACACHE_INDEX"].startswith("redis://")
    assert config["MEGACACHE_BLOB_STORE"] == "s3"
    secret = by_kind("Secret")
    keys = set(secret["stringData"])
    assert {"signing-key.pem", "admin-token"} <= keys
    used = {e["valueFrom"]["secretKeyRef"]["key"] for e in server["env"] if "valueFrom" in e}
    volumes = by_kind("Deployment")["spec"]["template"]["spec"]["volumes"]
    used |= {i["key"] for v in volumes if "secret" in v for i in v["secret"]["items"]}
    assert used <= keys and "signing-key.pem" in used
    key_file = next(e["value"] for e in server["env"]
                    if e["name"] == "MEGACACHE_SIGNING_KEY_FILE")
    mount = next(m for m in server["volumeMounts"] if m["name"] == "signing-key")
    assert key_file == f"{mount['mountPath']}/signing-key.pem"
