"""Render helm/spindle offline with an embedded Helm (helm-python-sdk) and look at what came out."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[1] / "helm" / "spindle"
RELEASE, NAMESPACE = "demo", "llm"
SELECTOR_KEYS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")

_S3_MODEL = {"source": {"type": "s3", "s3": {"uri": "s3://llm-models/llama-3.1-8b-instruct/"}}}
_IRSA = {"auth": "irsa", "irsaRoleArn": "arn:aws:iam::123456789012:role/spindle", "region": "eu-west-1"}

# The value sets every render test runs on: name -> values given to `helm install -f`.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu": {"model": {"variant": "cpu", "replicas": 2}},
    "external-redis": {
        "redis": {
            "enabled": False,
            "external": {"url": "rediss://redis.data.svc:6380/2", "existingSecret": "redis-auth"},
        }
    },
    "in-chart-redis-persistent": {"redis": {"persistence": {"enabled": True, "size": "5Gi"}}},
    "irsa": {
        "adapterService": {"s3": {"enabled": True, "bucket": "llm-adapters"}},
        "s3": _IRSA,
        "model": _S3_MODEL,
    },
    "irsa-model-only": {"s3": _IRSA, "model": _S3_MODEL},  # adapters on the volume, the model from S3
    "s3-keys-minio": {
        "s3": {"endpointUrl": "http://minio.storage:9000", "accessKeyId": "AKIA", "secretAccessKey": "s"},
        "model": {
            "source": {"type": "pvc", "pvc": {"claimName": "models", "path": "llama-3.1-8b"}},
            "servedModelName": "llama-3.1-8b",
            "gpu": {"type": "h100-80gb", "count": 2},
            "config": {"max-loras": 8, "kv-cache-memory-bytes": 21474836480, "gpu-memory-utilization": 0.85},
        },
        "adapterService": {
            "s3": {"enabled": True, "bucket": "adapters", "prefix": "prod/"},
            "config": {"max-adapter-bytes": 1073741824},
        },
    },
    "autoscaling": {
        "gateway": {
            "autoscaling": {"enabled": True},
            "config": {"max-attempts": 2},
            "podMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        },
        "model": {"keda": {"enabled": True}, "serviceMonitor": {"enabled": True}},
    },
    "network-policy": {
        "networkPolicy": {
            "enabled": True,
            "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
        },
        "otel": {"endpoint": "http://otel-collector.observability:4317"},
    },
    "mtls-own-token": {
        "tls": {"enabled": True, "existingSecret": "spindle-tls", "gatewayRequiresClientCert": True},
        "controlToken": {"existingSecret": "spindle-token"},
        "reasoningKey": {"existingSecret": "spindle-reasoning", "key": "signing-key"},
        "networkPolicy": {
            "enabled": True,
            "modelHttpFrom": [{"namespaceSelector": {"matchLabels": {"name": "inference-gateway"}}}],
        },
    },
    "no-control-token": {"controlToken": {"enabled": False}},
    "no-http": {"gateway": {"httpPort": 0}, "model": {"httpPort": 0}},
    "gateway-metrics-off": {"gateway": {"metricsPort": 0, "podMonitor": {"enabled": True}}},
    "statefulset-no-adapter-service": {
        "model": {"adapterCache": {"persistence": True}, "keda": {"enabled": True}},
        "adapterService": {"enabled": False},
        "networkPolicy": {"enabled": True},
    },
}


@functools.cache
def _render(values_json: str) -> tuple[dict[str, Any], ...]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return tuple(docs)


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The rendered objects (a fresh copy: tests may change them)."""
    return copy.deepcopy(list(_render(json.dumps(values, sort_keys=True))))


def notes(values: dict[str, Any]) -> str:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in files.items() if path.endswith("NOTES.txt"))


def one(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def workloads(objects: list[dict]) -> dict[str, dict]:
    """component -> its Deployment or StatefulSet."""
    return {component(o): o for o in objects if o["kind"] in WORKLOAD_KINDS}


def pod_labels(workload: dict) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container_env(container: dict) -> dict[str, str | None]:
    """name -> value; None for a value taken from a Secret or the downward API."""
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def main_container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def port_number(container: dict, name: str) -> int:
    found = [p["containerPort"] for p in container.get("ports", []) if p["name"] == name]
    assert len(found) == 1, f"container {container['name']} has no port named {name!r}"
    return found[0]


def fqdn(name: str) -> str:
    return f"{name}.{NAMESPACE}.svc.cluster.local"
