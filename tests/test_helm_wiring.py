"""The chart against the services' own definitions: each SPINDLE_* variable it sets is one the
service's parser reads and accepts; ports and probes are where the processes listen; addresses,
Service / PDB / ServiceMonitor / NetworkPolicy selectors reach the pods they mean."""

from __future__ import annotations

import argparse
import functools
import json
import re
import tempfile
from pathlib import Path

import helm_python as helm
import pytest
from helm_chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    component,
    container_env,
    fqdn,
    main_container,
    matches,
    pod_labels,
    port_number,
    render,
    workloads,
)

from adapter_service import base_model
from spindle import cli, envflags

# Each service's parser: component -> (module, builder). After a move, change the line here.
PARSERS = {"gateway": "gateway", "model": "serve", "adapter-service": "adapter-service"}  # `spindle` commands
# Variables the chart sets ahead of the service that will read them; drop each once it lands.
PENDING: dict[tuple[str, str], str] = {}
ANYONE = "anyone"


def build_parser(name: str) -> argparse.ArgumentParser:
    """The parser `spindle COMMAND` uses, environment variables applied when it is built."""
    return cli.command_parser(PARSERS[name])[1]


def accepted_variables(parser: argparse.ArgumentParser) -> set[str]:
    return {
        envflags.env_name(option)
        for action in parser._actions
        for option in action.option_strings[:1]
        if option.startswith("--") and not isinstance(action, argparse._HelpAction)
    }


def read_by_code(name: str, variable: str) -> bool:
    """A secret such as SPINDLE_REDIS_PASSWORD may be read from the environment, not as a flag:
    by the service's package, or by the shared code every service builds on (spindle/: the
    Redis client's password)."""
    package = Path(cli.command_parser(PARSERS[name])[0].__file__).parent
    shared = Path(envflags.__file__).parent
    return any(variable in f.read_text() for p in (package, shared) for f in p.rglob("*.py"))


# Variables naming a file that the parser itself reads (the file is in a Secret, not here): the
# chart's path is checked against its mounts; the parser gets a file of this content instead.
READ_WHEN_PARSED = {"SPINDLE_REASONING_KEY_FILE": b"k" * 32}


@functools.cache
def _stand_in(variable: str) -> str:
    """A file holding READ_WHEN_PARSED[variable], for the parser to read."""
    path = Path(tempfile.mkdtemp(prefix="helm-wiring-"), variable.lower())
    path.write_bytes(READ_WHEN_PARSED[variable])
    return str(path)


def parse_env(name: str, env: dict[str, str | None], monkeypatch) -> argparse.Namespace:
    """What the service makes of the container's SPINDLE_* variables (a pending one left out)."""
    env = {k: _stand_in(k) if k in READ_WHEN_PARSED and v else v for k, v in env.items()}
    accepted = accepted_variables(build_parser(name))
    ours = {k: v for k, v in env.items() if k.startswith(envflags.PREFIX)}
    unknown = sorted(
        k for k in ours if k not in accepted and (name, k) not in PENDING and not read_by_code(name, k)
    )
    assert not unknown, f"{name}: the chart sets variables its parser does not read: {unknown}"
    for key in accepted | ours.keys():
        monkeypatch.delenv(key, raising=False)
    for key, value in ours.items():
        if key in accepted:
            monkeypatch.setenv(key, "secret-from-a-secretKeyRef" if value is None else value)
    try:
        return build_parser(name).parse_args([])
    except SystemExit as e:  # argparse refused a value
        pytest.fail(f"{name}: `spindle` refuses the chart's environment (exit {e.code})")


@pytest.mark.parametrize(("name", "variable"), sorted(PENDING))
def test_pending_variables_are_read_by_their_service(name, variable):
    env = container_env(main_container(workloads(render({}))[name]))
    assert variable in env, f"the chart no longer sets {variable}: drop it from PENDING"
    if variable not in accepted_variables(build_parser(name)):
        pytest.xfail(PENDING[(name, variable)])


def probe_ports(container: dict, http_ready: bool) -> set[int]:
    """The probes' ports: grpc.health.v1, or a TCP connect for the startup and liveness probes of
    a service whose health tracks its dependencies; readiness is GET /health on the `http` port
    when `http_ready` (an OpenAI HTTP port in plaintext)."""
    alive = [container[p] for p in ("startupProbe", "livenessProbe")]
    assert all(("grpc" in p) != ("tcpSocket" in p) for p in alive), f"{container['name']}: {alive}"
    ready = container["readinessProbe"]
    if http_ready:
        assert ready["httpGet"] == {"path": "/health", "port": "http"}
    else:
        alive.append(ready)
        assert "grpc" in ready, f"{container['name']}: readiness is grpc.health.v1"
    return {(p.get("grpc") or p["tcpSocket"])["port"] for p in alive}


# What each service's grpc.health.v1 status says besides "this process works": the gateway is
# NOT_SERVING while no model pod is in rotation, the adapter service while Redis or its storage
# does not answer; a model pod's status is its own (loading, draining, a lost device).
HEALTH_TRACKS_DEPENDENCIES = {"gateway": True, "adapter-service": True, "model": False}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_no_pod_is_killed_for_what_it_depends_on(value_set):
    """A gateway used to run grpc.health.v1 startup (60 s) and liveness probes: while the model pods
    loaded a big checkpoint (up to model.probes.startupSeconds, 900 s) every gateway was killed
    into CrashLoopBackOff, and all of them again whenever the model pods (or, for the adapter
    service, Redis) went away: restarts that mend nothing. Only readiness may follow dependencies."""
    deployed = workloads(render(VALUE_SETS[value_set]))
    for name, tracks in HEALTH_TRACKS_DEPENDENCIES.items():
        if name not in deployed:
            continue
        container = main_container(deployed[name])
        for probe in ("startupProbe", "livenessProbe"):
            assert ("tcpSocket" in container[probe]) == tracks, f"{name} {probe}: {container[probe]}"
            assert ("grpc" in container[probe]) != tracks, f"{name} {probe}: {container[probe]}"


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
@pytest.mark.parametrize("name", sorted(PARSERS))
def test_environment_ports_and_probes_match_the_service(name, value_set, monkeypatch):
    deployed = workloads(render(VALUE_SETS[value_set]))
    if name not in deployed:
        pytest.skip(f"{name} is off in {value_set}")
    spec = deployed[name]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    args = parse_env(name, container_env(container), monkeypatch)
    assert port_number(container, "grpc") == args.port
    http = getattr(args, "http_port", 0)
    if http:
        assert port_number(container, "http") == http
    else:
        assert "http" not in {p["name"] for p in container["ports"]}
    http_ready = bool(http) and not args.tls_cert_file
    assert probe_ports(container, http_ready) == {args.health_port or args.port}  # plaintext health with TLS
    if getattr(args, "metrics_port", 0):
        assert port_number(container, "metrics") == args.metrics_port
    else:  # off: no port for a PodMonitor or NetworkPolicy to name
        assert "metrics" not in {p["name"] for p in container["ports"]}
    if hasattr(args, "drain_timeout"):
        assert spec["terminationGracePeriodSeconds"] > args.drain_timeout
        live = container["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] > args.drain_timeout
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    if name == "gateway":  # what `spindle gateway` requires before it starts
        assert bool(args.pods) != bool(args.pods_dns) and not args.allow_unauthenticated
        assert args.api_keys_file in mounts
    if name == "model":
        from model_service.engine.config import engine_config

        engine_config(args)  # the chart's engine settings are in their ranges (ConfigError otherwise)
        if hasattr(args, "control_port"):
            assert port_number(container, "control") == args.control_port
        assert args.adapter_cache_dir in mounts


def model_files(workload: dict, path: str) -> tuple[str, str, str]:
    """Where a path inside the pod comes from: ("alias", NAME, ""), ("pvc", CLAIM, PATH IN IT) or
    ("s3", URI, PATH UNDER IT) for an emptyDir an init container syncs from S3."""
    spec = workload["spec"]["template"]["spec"]
    mounts = [
        m for m in main_container(workload)["volumeMounts"] if Path(path).is_relative_to(m["mountPath"])
    ]
    if not mounts:
        return "alias", path, ""
    (mount,) = mounts
    inside = str(Path(path).relative_to(mount["mountPath"]))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    if "persistentVolumeClaim" in volume:
        return "pvc", volume["persistentVolumeClaim"]["claimName"], inside
    (fetch,) = [
        c for c in spec.get("initContainers", []) if mount["name"] in {m["name"] for m in c["volumeMounts"]}
    ]
    (init_mount,) = [m for m in fetch["volumeMounts"] if m["name"] == mount["name"]]
    uri, destination = fetch["command"][-2:]
    assert uri.startswith("s3://") and Path(destination).is_relative_to(init_mount["mountPath"])
    under = Path(init_mount["mountPath"], inside).relative_to(destination)
    return "s3", uri, str(under)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_the_adapter_service_checks_uploads_against_the_pods_model(value_set, monkeypatch):
    """--base-model is the checkpoint the pods load (an alias, or the same files), not a name."""
    deployed = workloads(render(VALUE_SETS[value_set]))
    if "adapter-service" not in deployed:
        pytest.skip(f"the adapter service is off in {value_set}")
    model, service = deployed["model"], deployed["adapter-service"]
    loaded = parse_env("model", container_env(main_container(model)), monkeypatch).model
    base = parse_env("adapter-service", container_env(main_container(service)), monkeypatch).base_model
    pods, checked = model_files(model, loaded), model_files(service, base)
    assert checked == pods, f"the pods load {pods}, the adapter service checks uploads against {checked}"
    if pods[0] == "alias":
        assert base_model.load(base)


@pytest.mark.parametrize("gpus", [None, 1, 2, 8])
@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_the_model_pod_uses_every_gpu_it_requests(variant, gpus, monkeypatch):
    """One tensor-parallel rank per requested GPU (the ranks share /dev/shm, not the runtime's 64 MiB)."""
    model = {"variant": variant} | ({"gpu": {"count": gpus}} if gpus else {})
    workload = workloads(render({"model": model}))["model"]
    container = main_container(workload)
    args = parse_env("model", container_env(container), monkeypatch)
    requested = container["resources"]["limits"].get("nvidia.com/gpu", 0)
    assert requested == (gpus or 1 if variant == "gpu" else 0)
    assert args.tensor_parallel_size == max(requested, 1)
    shm = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    if args.tensor_parallel_size > 1:
        (mount,) = shm
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory"
    else:
        assert not shm


@pytest.mark.parametrize(
    ("values", "name", "expected"),
    [
        ({"model": {"config": {"engine-stall-timeout": 600}}}, "model", {"engine_stall_timeout": 600}),
        ({"model": {"config": {"enable-expert-parallel": True}}}, "model", {"enable_expert_parallel": True}),
        ({"gateway": {"config": {"placement-timeout": 120}}}, "gateway", {"placement_timeout": 120}),
        ({"gateway": {"config": {"send-timeout": 30}}}, "gateway", {"send_timeout": 30}),
        ({"model": {"config": {"send-timeout": 0}}}, "model", {"send_timeout": 0}),
        ({"gateway": {"config": {"tool-call-parser": "hermes"}}}, "gateway", {"tool_call_parser": "hermes"}),
        ({"model": {"config": {"tool-call-parser": "hermes"}}}, "model", {"tool_call_parser": "hermes"}),
        ({"model": {"config": {"tool-call-parser": "mistral"}}}, "model", {"tool_call_parser": "mistral"}),
        (
            {"gateway": {"config": {"tool-call-parser": "pythonic"}}},
            "gateway",
            {"tool_call_parser": "pythonic"},
        ),
        ({"gateway": {"config": {"reasoning-parser": "qwen3"}}}, "gateway", {"reasoning_parser": "qwen3"}),
        (
            {"model": {"config": {"reasoning-parser": "deepseek_r1"}}},
            "model",
            {"reasoning_parser": "deepseek_r1"},
        ),
        # What the pods accept, the adapter service accepts at upload (unless told otherwise).
        (
            {"model": {"config": {"max-lora-rank": 128, "max-adapter-bytes": 4294967296}}},
            "adapter-service",
            {"max_lora_rank": 128, "max_adapter_bytes": 4294967296},
        ),
        (
            {"model": {"config": {"max-lora-rank": 128}}, "adapterService": {"config": {"max-lora-rank": 8}}},
            "adapter-service",
            {"max_lora_rank": 8},
        ),
    ],
)
def test_config_reaches_the_service(values, name, expected, monkeypatch):
    args = parse_env(name, container_env(main_container(workloads(render(values))[name])), monkeypatch)
    assert {key: getattr(args, key) for key in expected} == expected


def resolve(objects: list[dict], address: str) -> tuple[str, str, dict]:
    """HOST:PORT (or redis://HOST:PORT/..) -> (component, container port name, Service) it reaches."""
    host, port = re.sub(r"^\w+://", "", address).split("/")[0].rsplit(":", 1)
    services = [
        o
        for o in objects
        if o["kind"] == "Service" and host in (o["metadata"]["name"], fqdn(o["metadata"]["name"]))
    ]
    assert len(services) == 1, f"{address}: no Service of the release is {host}"
    (service,) = services
    (sp,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
    (target,) = [
        w for w in workloads(objects).values() if matches(service["spec"]["selector"], pod_labels(w))
    ]
    port_names = {p["containerPort"]: p["name"] for p in main_container(target)["ports"]}
    target_name = sp["targetPort"] if isinstance(sp["targetPort"], str) else port_names[sp["targetPort"]]
    assert target_name in port_names.values()
    if service["spec"].get("clusterIP") == "None":  # a headless name resolves to the pods: no port mapping
        assert port_names.get(int(port)) == target_name, f"{address}: the pods do not listen on {port}"
    return component(target), target_name, service


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_addresses_reach_the_ports_they_mean(value_set):
    objects = render(VALUE_SETS[value_set])
    deployed = workloads(objects)
    gateway_env = container_env(main_container(deployed["gateway"]))
    reached, port_name, service = resolve(objects, gateway_env["SPINDLE_PODS_DNS"])
    assert (reached, port_name) == ("model", "grpc")
    assert service["spec"]["clusterIP"] == "None"  # the gateway needs one address a pod
    if "adapter-service" not in deployed:
        assert "SPINDLE_ADAPTER_SERVICE" not in gateway_env
        return
    assert resolve(objects, gateway_env["SPINDLE_ADAPTER_SERVICE"])[:2] == ("adapter-service", "grpc")
    adapter_env = container_env(main_container(deployed["adapter-service"]))
    assert resolve(objects, adapter_env["SPINDLE_PODS_DNS"])[:2] == ("model", "control")
    if "redis" in deployed:
        assert resolve(objects, adapter_env["SPINDLE_REDIS_URL"])[:2] == ("redis", "redis")
    else:
        assert adapter_env["SPINDLE_REDIS_URL"] == VALUE_SETS[value_set]["redis"]["external"]["url"]
    assert "SPINDLE_REDIS_PASSWORD" in adapter_env
    # the gateway's stored responses in the same Redis, shared by its replicas
    assert gateway_env["SPINDLE_RESPONSES_STORE_REDIS_URL"] == adapter_env["SPINDLE_REDIS_URL"]
    gateway, adapter = (main_container(deployed[n]) for n in ("gateway", "adapter-service"))
    assert _env_entry(gateway, "SPINDLE_REDIS_PASSWORD") == _env_entry(adapter, "SPINDLE_REDIS_PASSWORD")


def _env_entry(container: dict, name: str) -> dict:
    (entry,) = [e for e in container["env"] if e["name"] == name]
    return entry


@pytest.mark.parametrize(
    "values",
    [{"gateway": {"responsesStoreRedis": False}}, {"adapterService": {"enabled": False}}],
    ids=["turned-off", "no-redis"],
)
def test_the_gateway_keeps_responses_in_its_memory_without_the_charts_redis(values, monkeypatch):
    gateway = main_container(workloads(render(values))["gateway"])
    env = container_env(gateway)
    assert "SPINDLE_RESPONSES_STORE_REDIS_URL" not in env and "SPINDLE_REDIS_PASSWORD" not in env
    assert parse_env("gateway", env, monkeypatch).responses_store_redis_url == ""


def test_the_charts_redis_evicts_stored_responses_before_its_memory_limit():
    """The gateway's stored responses share the chart's Redis with the adapter registry: past
    `redis.maxmemory` (below the container's limit) Redis evicts keys that expire, least recently
    used first, where it would have grown until the container was killed, registry and all."""
    redis = main_container(workloads(render({"redis": {"maxmemory": "100mb"}}))["redis"])
    script = redis["command"][-1]
    assert "--maxmemory 100mb --maxmemory-policy volatile-lru" in script, script


def test_a_response_kept_in_the_charts_redis_is_capped_far_below_its_maxmemory(monkeypatch):
    """One response larger than Redis' free memory had it evict every expiring key, the registry's
    leases among them, and still refuse the write: the gateway's default cap (256 MB) was above
    the chart's maxmemory (192mb). The chart now caps one response at 8 MiB; a cap given in
    gateway.config wins."""
    env = container_env(main_container(workloads(render({}))["gateway"]))
    assert parse_env("gateway", env, monkeypatch).responses_store_max_bytes == 8 << 20
    given = {"gateway": {"config": {"responses-store-max-bytes": 1000}}}
    env = container_env(main_container(workloads(render(given))["gateway"]))
    assert parse_env("gateway", env, monkeypatch).responses_store_max_bytes == 1000


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_selectors_match_the_pods_they_mean(value_set):
    objects = render(VALUE_SETS[value_set])
    deployed = workloads(objects)
    for name, workload in deployed.items():
        assert matches(workload["spec"]["selector"]["matchLabels"], pod_labels(workload))
        others = [w for n, w in deployed.items() if n != name]
        assert not any(matches(workload["spec"]["selector"]["matchLabels"], pod_labels(w)) for w in others)
    for obj in objects:
        kind = obj["kind"]
        if kind == "Service":
            selected = [n for n, w in deployed.items() if matches(obj["spec"]["selector"], pod_labels(w))]
            assert selected == [component(obj)], f"Service {obj['metadata']['name']} selects {selected}"
            ports = {p["name"] for p in main_container(deployed[selected[0]])["ports"]}
            assert {p["targetPort"] for p in obj["spec"]["ports"]} <= ports
        elif kind == "PodDisruptionBudget":
            selected = [
                n
                for n, w in deployed.items()
                if matches(obj["spec"]["selector"]["matchLabels"], pod_labels(w))
            ]
            assert selected == [component(obj)]
        elif kind == "ServiceMonitor":
            (service,) = [
                s
                for s in objects
                if s["kind"] == "Service"
                and matches(obj["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
            ]
            assert {e["port"] for e in obj["spec"]["endpoints"]} <= {
                p["name"] for p in service["spec"]["ports"]
            }
            assert obj["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
        elif kind == "PodMonitor":  # the gateway's: its Service is the callers' and has no metrics port
            selector = obj["spec"]["selector"]["matchLabels"]
            (selected,) = [w for w in deployed.values() if matches(selector, pod_labels(w))]
            ports = {p["name"] for p in main_container(selected)["ports"]}
            assert {e["port"] for e in obj["spec"]["podMetricsEndpoints"]} <= ports
            assert obj["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
        elif kind in ("ScaledObject", "HorizontalPodAutoscaler"):
            target = obj["spec"]["scaleTargetRef"]
            (scaled,) = [
                w
                for w in deployed.values()
                if (w["kind"], w["metadata"]["name"]) == (target["kind"], target["name"])
            ]
            assert "replicas" not in scaled["spec"], "the autoscaler, not the chart, sets the replicas"
            if kind == "ScaledObject":
                _check_queue_query(obj, scaled, deployed)


def _check_queue_query(scaled_object: dict, target: dict, deployed: dict) -> None:
    (trigger,) = scaled_object["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    assert "vllm:num_requests_waiting" in query
    pod_regex = re.search(r'pod=~"([^"]+)"', query).group(1)
    name = target["metadata"]["name"]
    assert re.fullmatch(pod_regex, f"{name}-5d8f7c9b4-x2x7q") and re.fullmatch(pod_regex, f"{name}-0")
    for other in deployed.values():
        if other is not target:
            assert not re.fullmatch(pod_regex, f"{other['metadata']['name']}-5d8f7c9b4-x2x7q")


def allowed_sources(objects: list[dict], target: str, port_name: str) -> set[str] | str:
    """Which components' pods the NetworkPolicies let reach `port_name` of `target`'s pods."""
    deployed = workloads(objects)
    labels = pod_labels(deployed[target])
    policies = [
        o
        for o in objects
        if o["kind"] == "NetworkPolicy" and matches(o["spec"]["podSelector"]["matchLabels"], labels)
    ]
    assert policies, f"no NetworkPolicy selects the {target} pods"
    sources: set[str] = set()
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if not any(p["port"] == port_name for p in rule.get("ports", [])):
                continue
            if "from" not in rule:
                return ANYONE
            for peer in rule["from"]:
                if "podSelector" not in peer or "namespaceSelector" in peer:
                    return ANYONE  # pods in other namespaces, or IP blocks
                sources |= {
                    n
                    for n, w in deployed.items()
                    if matches(peer["podSelector"]["matchLabels"], pod_labels(w))
                }
    return sources


@pytest.mark.parametrize("value_set", ["network-policy", "statefulset-no-adapter-service"])
def test_network_policies_let_in_only_who_must(value_set):
    objects = render(VALUE_SETS[value_set])
    deployed = workloads(objects)
    adapter = {"adapter-service"} & deployed.keys()
    assert allowed_sources(objects, "model", "grpc") == {"gateway"}
    assert allowed_sources(objects, "model", "control") == {"model"} | adapter
    assert allowed_sources(objects, "gateway", "grpc") == ANYONE
    assert allowed_sources(objects, "gateway", "http") == ANYONE  # the same callers, the same API keys
    gateway_rules = next(o for o in objects if o["kind"] == "NetworkPolicy" and component(o) == "gateway")
    (metrics_rule,) = [r for r in gateway_rules["spec"]["ingress"] if r["ports"][0]["port"] == "metrics"]
    assert metrics_rule.get("from") == (VALUE_SETS[value_set]["networkPolicy"].get("metricsFrom") or None)
    http = "http" in {p["name"] for p in main_container(deployed["model"])["ports"]}
    assert not http or allowed_sources(objects, "model", "http") == {"gateway"}  # no keys on a pod
    if adapter:
        assert allowed_sources(objects, "adapter-service", "grpc") == {"gateway", "model"}  # weight pulls
    if "redis" in deployed:
        assert allowed_sources(objects, "redis", "redis") == {"adapter-service", "gateway"}
    for name, workload in deployed.items():
        for port in main_container(workload)["ports"]:
            assert allowed_sources(objects, name, port["name"]), f"nobody may reach {name}:{port['name']}"


@pytest.mark.parametrize(
    ("value_set", "monitored"), [("default", False), ("autoscaling", True), ("gateway-metrics-off", False)]
)
def test_the_gateway_pod_monitor_follows_its_metrics_port(value_set, monitored):
    """A PodMonitor when asked for and the gateway serves /metrics; never a metrics port on the
    gateway's Service (the callers' door, often a LoadBalancer)."""
    objects = render(VALUE_SETS[value_set])
    monitors = [o for o in objects if o["kind"] == "PodMonitor"]
    assert len(monitors) == monitored
    if monitored:
        assert monitors[0]["metadata"]["labels"]["release"] == "prometheus"
    (service,) = [o for o in objects if o["kind"] == "Service" and component(o) == "gateway"]
    assert "metrics" not in {p["name"] for p in service["spec"]["ports"]}


def test_no_network_policy_unless_asked():
    assert not [o for o in render(VALUE_SETS["default"]) if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_container_is_locked_down_and_traced(value_set):
    for name, workload in workloads(render(VALUE_SETS[value_set])).items():
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for container in spec.get("initContainers", []) + spec["containers"]:
            security = container["securityContext"]
            assert (
                security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
            )
            assert security["capabilities"]["drop"] == ["ALL"]
            assert {"requests", "limits"} <= container["resources"].keys()
            assert "memory" in container["resources"]["limits"]
        if name != "redis":
            env = container_env(spec["containers"][0])
            assert env["OTEL_SERVICE_NAME"] == f"spindle-{name}"
            endpoint = VALUE_SETS[value_set].get("otel", {}).get("endpoint")
            assert env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == endpoint


def secret_volumes(workload: dict) -> dict[str, str]:
    """mount path -> the Secret mounted there, whole (no subPath: rotated files must show)."""
    spec = workload["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    mounts = main_container(workload)["volumeMounts"]
    assert not [m for m in mounts if m["name"] in secrets and "subPath" in m]
    return {m["mountPath"]: secrets[m["name"]] for m in mounts if m["name"] in secrets}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
@pytest.mark.parametrize("name", sorted(PARSERS))
def test_tls_and_the_service_token_reach_every_service(name, value_set, monkeypatch):
    values = VALUE_SETS[value_set]
    objects = render(values)
    deployed = workloads(objects)
    if name not in deployed:
        pytest.skip(f"{name} is off in {value_set}")
    args = parse_env(name, container_env(main_container(deployed[name])), monkeypatch)
    mounted = secret_volumes(deployed[name])
    tls, token = values.get("tls", {}), values.get("controlToken", {})
    if tls.get("enabled"):
        for path in (args.tls_cert_file, args.tls_key_file, args.tls_ca_file):
            assert mounted[str(Path(path).parent)] == tls["existingSecret"]
        assert args.tls_server_name and args.health_port
        mutual = tls.get("gatewayRequiresClientCert", False) if name == "gateway" else tls.get("mutual", True)
        assert args.tls_require_client_cert is mutual
    else:
        assert not (args.tls_cert_file or args.tls_ca_file or args.health_port)
    if token.get("enabled", True):
        secret = mounted[str(Path(args.control_token_file).parent)]
        assert secret == (token.get("existingSecret") or f"{RELEASE}-spindle-control-token")
        made = [o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == secret]
        assert bool(made) != bool(token.get("existingSecret"))  # the chart makes it unless given
        assert not made or made[0]["data"]["token"]
        assert Path(args.control_token_file).name == "token"
    else:
        assert not args.control_token_file


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_the_reasoning_key_reaches_the_gateway_and_the_model_pods(value_set, monkeypatch):
    """reasoningKey.existingSecret: the Secret mounted whole and read-only in the gateway and the
    model pods (which must share the key to accept each other's reasoning blobs), and
    --reasoning-key-file naming its key there, read by both into the key; with no Secret, none. A
    chart user could not set it before: `config` takes no file flags, and the key is a Secret."""
    wanted = VALUE_SETS[value_set].get("reasoningKey", {})
    deployed = workloads(render(VALUE_SETS[value_set]))
    for name, workload in ((n, deployed[n]) for n in PARSERS if n in deployed):
        container = main_container(workload)
        path = container_env(container).get("SPINDLE_REASONING_KEY_FILE")
        if not wanted.get("existingSecret") or name not in ("gateway", "model"):
            assert path is None and "reasoning-key" not in {m["name"] for m in container["volumeMounts"]}
            continue
        assert secret_volumes(workload)[str(Path(path).parent)] == wanted["existingSecret"]
        assert Path(path).name == wanted["key"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(Path(path).parent)]
        assert mount["readOnly"] is True
        assert parse_env(name, container_env(container), monkeypatch).reasoning_key_file == b"k" * 32


def test_tls_without_its_secret_is_refused_naming_the_value():
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmRenderError, match=r"tls\.existingSecret"):
        chart.render({"tls": {"enabled": True}}, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_the_config_flags_the_schema_allows_are_the_services_own(name):
    """Each `config` key values.schema.json allows is a flag of that service that the chart does
    not already set itself: rendered with all of them, no variable appears twice."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    key = {"model": "model", "gateway": "gateway", "adapter-service": "adapterService"}[name]
    config_schema = schema["properties"][key]["properties"]["config"]
    flags = config_schema["propertyNames"]["enum"]
    variables = [envflags.env_name(flag) for flag in flags]
    choices = {flag: _enum(schema, s) for flag, s in config_schema.get("properties", {}).items()}
    config = {flag: choices[flag][-1] if flag in choices else 1 for flag in flags}
    env = main_container(workloads(render({key: {"config": config}}))[name])["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)) and set(variables) <= set(names)
    assert set(variables) <= accepted_variables(build_parser(name))


def _enum(schema: dict, prop: dict) -> list:
    """The values a schema property allows (through its `$ref`, where it has one)."""
    ref = prop.get("$ref", "")
    return (schema["definitions"][ref.split("/")[-1]] if ref else prop)["enum"]


@pytest.mark.parametrize("name", ["gateway", "model"])
def test_the_parser_names_the_schema_allows_are_the_services_own(name):
    """`tool-call-parser` and `reasoning-parser` in `config`: the chart allows exactly the names
    the service takes (a misspelt one is refused at install, not in a crash-looping pod)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    config = schema["properties"][name]["properties"]["config"]["properties"]
    actions = {a.dest: a for a in build_parser(name)._actions}
    for flag in ("tool-call-parser", "reasoning-parser"):
        assert _enum(schema, config[flag]) == list(actions[flag.replace("-", "_")].choices), flag
