"""helm/spindle renders, lints and validates offline: Kubernetes 1.30's schemas (strict, so an unknown
field fails), the ServiceMonitor and ScaledObject CRDs' schemas, and values.schema.json's refusals."""

from __future__ import annotations

import functools
import json

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from helm_chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    main_container,
    matches,
    notes,
    one,
    pod_labels,
    render,
    workloads,
)

KUBE_VERSION = "1.30.0"


@functools.cache
def _crd_models() -> dict[str, type]:
    # Pydantic models generated from the CRDs' openAPI schemas by cloudcoil (PyPI):
    # prometheus-operator v0.80.1 (ServiceMonitor, PodMonitor) and KEDA v2.16.1 (ScaledObject).
    from cloudcoil.models.keda.v1alpha1 import ScaledObject
    from cloudcoil.models.prometheus_operator.v1 import PodMonitor, ServiceMonitor

    return {
        "monitoring.coreos.com/v1/ServiceMonitor": ServiceMonitor,
        "monitoring.coreos.com/v1/PodMonitor": PodMonitor,
        "keda.sh/v1alpha1/ScaledObject": ScaledObject,
    }


def validate_crd_object(obj: dict) -> None:
    """Against the CRD's schema, strictly: a field the CRD does not define is an error too."""
    model = _crd_models()[f"{obj['apiVersion']}/{obj['kind']}"]
    parsed = model.model_validate(obj, strict=True)
    back = parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert back == obj, f"{obj['kind']} has fields its CRD does not define:\n{back}\nvs\n{obj}"


def validate(obj: dict) -> None:
    if obj["apiVersion"].split("/")[0] in ("monitoring.coreos.com", "keda.sh"):
        validate_crd_object(obj)
    else:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_object_is_valid_for_kubernetes_1_30(value_set):
    objects = render(VALUE_SETS[value_set])
    assert {"Deployment", "Service", "ServiceAccount"} <= {o["kind"] for o in objects}
    for obj in objects:
        assert obj["metadata"]["name"].startswith(f"{RELEASE}-spindle"), obj["metadata"]["name"]
        validate(obj)


def test_the_validators_are_strict():
    """A misspelt field is caught by both validators, so the test above can fail."""
    objects = render(VALUE_SETS["autoscaling"])
    deployment = workloads(objects)["gateway"]
    main_container(deployment)["readinesProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        validate(deployment)
    scaled = next(o for o in objects if o["kind"] == "ScaledObject")
    scaled["spec"]["maxReplicas"] = 4  # the CRD calls it maxReplicaCount
    with pytest.raises(AssertionError, match="fields its CRD does not define"):
        validate(scaled)
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["interval"] = 15  # a duration string in the CRD
    with pytest.raises(ValueError, match="interval"):
        validate(monitor)


def test_lint_is_clean():
    for values in (VALUE_SETS["default"], VALUE_SETS["network-policy"]):
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not problems and not report["errors"], report


@pytest.mark.parametrize(
    ("values", "path", "why"),
    [
        ({"model": {"replicas": -1}}, "/model/replicas", "minimum"),
        ({"gateway": {"replicas": -2}}, "/gateway/replicas", "minimum"),
        ({"model": {"gpu": {"type": "h800"}}}, "/model/gpu/type", "must be one of"),
        ({"adapterService": {"s3": {"enabled": True}}}, "/adapterService/s3/bucket", "pattern"),
        ({"redis": {"enabled": False}}, "/redis/external/url", "minLength"),
        ({"redis": {"maxmemory": "192M"}}, "/redis/maxmemory", "pattern"),
        ({"s3": {"auth": "irsa"}}, "/s3/irsaRoleArn", "pattern"),
        ({"model": {"source": {"type": "pvc"}}}, "/model/source/pvc/claimName", "minLength"),
        (
            {"model": {"source": {"type": "s3", "s3": {"uri": "https://x/"}}}},
            "/model/source/s3/uri",
            "pattern",
        ),
        ({"model": {"port": 70000}}, "/model/port", "maximum"),
        ({"model": {"variant": "tpu"}}, "/model/variant", "must be one of"),
        (
            {"model": {"config": {"tool-call-parser": "mistrall"}}},
            "/model/config/tool-call-parser",
            "must be one of",
        ),
        (
            {"gateway": {"config": {"tool-call-parser": "Pythonic"}}},
            "/gateway/config/tool-call-parser",
            "must be one of",
        ),
        (
            {"gateway": {"config": {"reasoning-parser": "r1"}}},
            "/gateway/config/reasoning-parser",
            "must be one of",
        ),
        ({"model": {"replica": 2}}, "/model", "additional properties 'replica'"),
        ({"securityContext": {"privileged": True}}, "/securityContext/privileged", "value must be false"),
        # Kubernetes refuses these: a rollout that may neither add nor remove a pod, a bare string;
        # a budget of 0% would block every eviction (as 0 would).
        (
            {"model": {"rollingUpdate": {"maxSurge": "0%", "maxUnavailable": 0}}},
            "/model/rollingUpdate",
            "not",
        ),
        ({"model": {"rollingUpdate": {"maxSurge": "1"}}}, "/model/rollingUpdate/maxSurge", "pattern"),
        ({"gateway": {"pdb": {"maxUnavailable": "1"}}}, "/gateway/pdb/maxUnavailable", "pattern"),
        ({"model": {"pdb": {"maxUnavailable": "0%"}}}, "/model/pdb/maxUnavailable", "pattern"),
    ],
)
def test_bad_values_are_refused_naming_the_value(values, path, why):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as refused:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(refused.value)
    assert f"at '{path}'" in message and why in message, message


def test_a_misspelt_flag_in_config_is_refused_naming_it():
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="'max-atempts'"):
        chart.render({"gateway": {"config": {"max-atempts": 3}}}, name=RELEASE, namespace=NAMESPACE)


def test_s3_without_credentials_is_refused_naming_the_value():
    values = {"adapterService": {"s3": {"enabled": True, "bucket": "adapters"}}}
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmRenderError, match=r"s3\.accessKeyId"):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_every_gpu_type_the_schema_allows_selects_nodes():
    allowed = json.loads((CHART / "values.schema.json").read_text())
    types = allowed["properties"]["model"]["properties"]["gpu"]["properties"]["type"]["enum"]
    products = set()
    for gpu in filter(None, types):
        spec = workloads(render({"model": {"gpu": {"type": gpu}}}))["model"]["spec"]["template"]["spec"]
        products.add(spec["nodeSelector"]["nvidia.com/gpu.product"])
    assert len(products) == len(types) - 1  # one distinct node label per key; "" selects none
    assert "nodeSelector" not in workloads(render({}))["model"]["spec"]["template"]["spec"]


def test_gpu_and_cpu_variants():
    gpu = main_container(workloads(render({}))["model"])
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == gpu["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert gpu["image"].endswith("-cuda")
    cpu = main_container(workloads(render(VALUE_SETS["cpu"]))["model"])
    assert not any("nvidia.com/gpu" in r for r in cpu["resources"].values())
    assert cpu["image"].endswith("-cpu")
    assert {"SPINDLE_DEVICE": "cpu"}.items() <= {e["name"]: e.get("value") for e in cpu["env"]}.items()


def test_large_numbers_reach_the_env_without_an_exponent():
    model = main_container(workloads(render(VALUE_SETS["s3-keys-minio"]))["model"])
    env = {e["name"]: e.get("value") for e in model["env"]}
    assert env["SPINDLE_KV_CACHE_MEMORY_BYTES"] == "21474836480"
    assert env["SPINDLE_GPU_MEMORY_UTILIZATION"] == "0.85"


def test_model_source_and_adapter_cache():
    spec = workloads(render(VALUE_SETS["irsa"]))["model"]["spec"]["template"]["spec"]
    (fetch,) = spec["initContainers"]
    assert VALUE_SETS["irsa"]["model"]["source"]["s3"]["uri"] in fetch["command"]
    assert {"name": "models", "mountPath": "/models"} in fetch["volumeMounts"]
    assert {v["name"]: v for v in spec["volumes"]}["models"]["emptyDir"]["sizeLimit"] == "40Gi"
    sts = workloads(render(VALUE_SETS["statefulset-no-adapter-service"]))["model"]
    assert sts["kind"] == "StatefulSet"
    assert [c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]] == ["adapter-cache"]


def test_the_adapter_service_runs_two_replicas_with_a_disruption_budget_on_shared_storage():
    name = f"{RELEASE}-spindle-adapter-service"
    for value_set in ("irsa", "s3-keys-minio"):  # S3: the replicas share it
        objects = render(VALUE_SETS[value_set])
        assert workloads(objects)["adapter-service"]["spec"]["replicas"] == 2
        assert one(objects, "PodDisruptionBudget", name)["spec"]["maxUnavailable"] == 1
    claim = render({"adapterService": {"storage": {"existingClaim": "adapters-rwx"}, "replicas": 3}})
    assert workloads(claim)["adapter-service"]["spec"]["replicas"] == 3
    objects = render({})  # the default emptyDir is one pod's: one replica, nothing to budget
    assert workloads(objects)["adapter-service"]["spec"]["replicas"] == 1
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == name]
    assert "The adapter service runs 1 replica, not 2" in notes({})
    assert "adapter service runs" not in notes(VALUE_SETS["irsa"])


@pytest.mark.parametrize(
    "value_set", ["irsa", "irsa-model-only"]
)  # the adapter service reads the model's config
def test_irsa_puts_the_role_on_the_service_accounts_and_no_keys_anywhere(value_set):
    objects = render(VALUE_SETS[value_set])
    role = VALUE_SETS[value_set]["s3"]["irsaRoleArn"]
    for name in (f"{RELEASE}-spindle-adapter-service", f"{RELEASE}-spindle-model"):
        annotations = one(objects, "ServiceAccount", name)["metadata"]["annotations"]
        assert annotations == {"eks.amazonaws.com/role-arn": role}
    assert "AWS_ACCESS_KEY_ID" not in yaml.safe_dump_all(objects)
    keyed = yaml.safe_dump_all(render(VALUE_SETS["s3-keys-minio"]))
    assert "AWS_ACCESS_KEY_ID" in keyed and "eks.amazonaws.com/role-arn" not in keyed


def test_notes_tell_how_to_reach_the_gateway():
    text = notes({})
    assert f"port-forward svc/{RELEASE}-spindle-gateway 50051:50051" in text
    assert f"get secret {RELEASE}-spindle-gateway-api-keys" in text and "spindle chat" in text
    assert "grpcurl -plaintext" in text and "--tls-ca-file" not in text
    mtls = {"enabled": True, "existingSecret": "spindle-tls", "gatewayRequiresClientCert": True}
    tls = notes({"tls": mtls})
    assert "get secret spindle-tls" in tls and "-plaintext" not in tls
    gateway = f"{RELEASE}-spindle-gateway"
    assert f"--tls-ca-file ca.crt --tls-server-name {gateway} --tls-cert-file client.crt" in tls


def _documented_keys(values: dict, prefix: str = "") -> list[str]:
    """values.yaml's keys as the README's table names them: whole blocks for images, resources
    and security contexts, and for maps that are empty by default."""
    keys = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        whole = key in ("image", "fetchImage", "resources") or path.endswith("ecurityContext")
        if isinstance(value, dict) and value and not whole:
            keys += _documented_keys(value, f"{path}.")
        else:
            keys.append(path)
    return keys


def test_the_readme_documents_every_value():
    table = (CHART / "README.md").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = [key for key in _documented_keys(values) if f"`{key}`" not in table]
    assert not missing, f"helm/spindle/README.md's table lacks {missing}"


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_gateway_and_adapter_service_replicas_spread_over_nodes(value_set):
    """Two gateways (or adapter services) could land on one node, and that node's loss took every
    replica the budget was meant to keep. Each replicated component now prefers other nodes, its
    constraint selecting its own pods (a selector matching none spreads nothing)."""
    for name, workload in workloads(render(VALUE_SETS[value_set])).items():
        if name not in ("gateway", "adapter-service") or workload["spec"].get("replicas") == 1:
            continue
        spec = workload["spec"]["template"]["spec"]
        (spread,) = spec["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["maxSkew"] == 1
        assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # one node still runs the chart
        assert matches(spread["labelSelector"]["matchLabels"], pod_labels(workload))
        assert spread["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == name


def test_topology_spread_is_the_values_own():
    zones = [
        {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    ]
    deployed = workloads(render({"gateway": {"topologySpreadConstraints": zones}, "model": {"replicas": 2}}))
    (spread,) = deployed["gateway"]["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone"
    assert matches(spread["labelSelector"]["matchLabels"], pod_labels(deployed["gateway"]))
    assert "topologySpreadConstraints" not in deployed["model"]["spec"]["template"]["spec"]  # a GPU each
    spread = workloads(render({"model": {"topologySpreadConstraints": zones}}))["model"]
    assert spread["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["labelSelector"]
    off = workloads(render({"gateway": {"topologySpreadConstraints": []}}))["gateway"]
    assert "topologySpreadConstraints" not in off["spec"]["template"]["spec"]


def test_the_ranks_shared_memory_is_sized_by_the_values():
    """/dev/shm was a fixed 1Gi: eight ranks whose NCCL buffers go through host memory (no
    peer-to-peer between PCIe GPUs) could not get more without editing the chart."""
    volumes = workloads(render({"model": {"gpu": {"count": 8, "shmSizeLimit": "16Gi"}}}))["model"]
    (shm,) = [v for v in volumes["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
