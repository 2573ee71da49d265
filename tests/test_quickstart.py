"""The main job: `spindle up` (model pod + gateway on the embedded SmolLM2) and the client CLI."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest
from grpc_health.v1 import health_pb2

from spindle import local
from spindle.cli import command_parser
from tests.service_helpers import ROOT
from tests.up_cluster import ADAPTER, try_lines

CLI = [sys.executable, "-m", "spindle.cli"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_up_answers_through_the_gateway_then_serves(spindle_up):
    """`spindle up` (tests/up_cluster.py; Ctrl-C's clean stop is checked when the session ends)."""
    up, gw = spindle_up, spindle_up.gateway
    # While the pod loads it is up but NOT_SERVING, and refuses work with UNAVAILABLE.
    assert health_pb2.HealthCheckResponse.NOT_SERVING in up.health_seen and up.refused_while_loading, (
        up.health_seen,
        up.refused_while_loading,
    )
    prompt, answer, with_adapter = up.answers
    assert prompt.startswith("> What is the capital of France?")
    assert answer.startswith("[base model] ") and "Paris" in answer
    assert with_adapter.startswith(f"[{ADAPTER}] ") and len(with_adapter.strip()) > len(f"[{ADAPTER}]")
    question = "What is the capital of Italy? Answer in one sentence."
    chat = _cli("chat", "--gateway", gw, "--temperature", "0", "--max-tokens", "24", "--json", question)
    assert chat.returncode == 0, chat.stderr
    out = json.loads(chat.stdout)
    assert "Rome" in out["text"] and out["usage"]["completion_tokens"] == len(out["token_ids"])
    complete = _cli("complete", "--gateway", gw, "--max-tokens", "5", "--seed", "1", "Once upon a")
    assert complete.returncode == 0 and complete.stdout.strip(), complete.stderr
    models = _cli("models", "--gateway", gw)
    assert models.stdout.startswith("smollm2-135m-instruct\tbase") and ADAPTER in models.stdout
    for args in (("--gateway", gw, "list"), ("list", "--gateway", gw)):  # connection flags before or after
        listed = _cli("adapters", *args)  # registered through the admin API
        assert listed.returncode == 0 and json.loads(listed.stdout)["name"] == ADAPTER, listed.stderr
    assert (up.storage / ADAPTER / "v000001" / "meta.json").is_file()
    bad = _cli("chat", "--gateway", gw, "--temperature", "-1", "hi")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "temperature" in bad.stderr


def test_up_prints_a_curl_line_and_an_sdk_snippet_that_work(spindle_up):
    """Run as printed, but for max_tokens (64 tokens of the random adapter cost seconds here)."""
    lines = [line.replace('"max_tokens": 64', '"max_tokens": 4') for line in try_lines(spindle_up)]
    (curl,) = [line for line in lines if line.startswith("curl ")]
    (sdk,) = [
        line.split("   # ")[0].replace("max_tokens=64", "max_tokens=4") for line in lines if "-c " in line
    ]
    assert spindle_up.http in curl and spindle_up.http in sdk and "max_tokens=4" in sdk and '": 4' in curl
    if shutil.which("curl"):
        answer = json.loads(
            subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60).stdout
        )
        assert answer["model"] == ADAPTER and answer["usage"]["completion_tokens"] <= 4
    python = shlex.quote(sys.executable)
    printed = subprocess.run(python + sdk.removeprefix("python"), shell=True, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert printed.returncode == 0 and printed.stdout.strip(), printed.stderr


def test_up_picks_free_ports_for_what_the_user_did_not_name():
    """Two local clusters need only different gateway ports: the internal ones are free ports."""
    _, parser = command_parser("up")
    args = parser.parse_args(["--gateway-port", "1", "--http-port", "2", "--pod-control-port", "3"])
    local._pick_free_ports(args)
    picked = [args.pod_port, args.pod_http_port, args.adapter_port, args.metrics_port]
    assert args.pod_control_port == 3 and len(set(picked)) == 4 and not {1, 2, 3} & set(picked)
    for port in picked:  # free: each can be bound
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    pod, service, gateway = local._commands(args, "token")
    assert pod[pod.index("--control-port") + 1] == "3" and pod[pod.index("--http-port") + 1] == str(picked[1])
    assert service[service.index("--pods") + 1] == "127.0.0.1:3"
    assert gateway[gateway.index("--pods") + 1] == f"127.0.0.1:{picked[0]}"
    text = local._try_it(args, "127.0.0.1:1", f"127.0.0.1:{picked[2]}")
    assert (
        "http://127.0.0.1:2/v1/chat/completions" in text and str(picked[2]) in text and str(picked[1]) in text
    )


def _help(command: str) -> str:
    """What `spindle COMMAND --help` prints, from the parser the command builds, without a process
    of its own: `serve`'s alone spends seconds importing the engine. The program itself answers
    `spindle --help` below."""
    return command_parser(command)[1].format_help()


def test_every_command_explains_itself():
    usage = _cli("--help").stdout
    for command in ("generate", "serve", "gateway", "up", "chat", "complete", "models", "adapters"):
        assert command in usage
    serve = _help("serve")
    for flag in ("--port", "--metrics-port", "--drain-timeout", "SPINDLE_PORT", "SPINDLE_MAX_NUM_SEQS",
                 "--http-port", "SPINDLE_HTTP_PORT"):  # fmt: skip
        assert flag in serve
    gateway = _help("gateway")
    for flag in ("--pods", "--pods-dns", "--api-keys-file", "SPINDLE_API_KEYS_FILE", "--health-interval",
                 "--http-port", "SPINDLE_HTTP_PORT"):  # fmt: skip
        assert flag in gateway
    service = _help("adapter-service")
    for flag in ("--s3-bucket", "--redis-url", "--pods-dns", "--base-model", "SPINDLE_STAGING_MAX_BYTES"):
        assert flag in service
    chat = _help("chat")
    assert "--adapter" in chat and "SPINDLE_API_KEY" in chat and "SPINDLE_GATEWAY" in chat
    no_pods = _cli("gateway", "--allow-unauthenticated")
    assert no_pods.returncode != 0 and "--pods" in no_pods.stderr


def test_a_port_in_use_is_one_line_and_the_ports_taken_before_it_are_freed():
    """A port in use was a traceback (OSError) from every binary, and when it came after servers had
    started (the gateway's HTTP port, the pod's metrics, health or HTTP port) gRPC's clean-up of
    them printed "Event loop is closed" tracebacks too. Now: `spindle: error: ...` naming the
    address, exit 2, and the ports the service had already taken are free again."""
    import asyncio

    import pytest

    from model_service.pod import server as pod_server
    from spindle.errors import ListenError
    from tests.service_helpers import free_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = str(held.getsockname()[1])
        gateway = _cli("gateway", "--host", "127.0.0.1", "--port", "0", "--http-port", busy, "--pods",
                       "127.0.0.1:1", "--allow-unauthenticated")  # fmt: skip
        assert gateway.returncode == 2, gateway.stderr
        assert f"spindle: error: cannot listen for HTTP on 127.0.0.1:{busy}" in gateway.stderr
        assert "Traceback" not in gateway.stderr and "Event loop is closed" not in gateway.stderr
        for flag in ("--metrics-port", "--health-port", "--http-port"):
            grpc_port, control_port = free_port(), free_port()
            args = command_parser("serve")[1].parse_args(
                ["--host", "127.0.0.1", "--port", str(grpc_port), "--control-port",
                 str(control_port), "--metrics-port", "0", "--http-port", "0", flag, busy]
            )  # fmt: skip
            with pytest.raises(ListenError, match=f"127.0.0.1:{busy}"):
                asyncio.run(pod_server.serve(args))
            for port in (grpc_port, control_port):  # stopped, not left to the garbage collector
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))


def test_a_service_that_cannot_listen_gives_the_os_reason():
    """`gateway --host 8.8.8.8` (another machine's address) or a name that does not resolve said
    "cannot listen on ... (is the port in use?)": the OS's reason now, the hint only where the port
    is in use."""
    import asyncio

    import grpc

    from spindle import serving
    from spindle.errors import ListenError

    async def bind(host: str, port: int) -> None:
        server = grpc.aio.server()
        try:
            serving.bind(server, host, port)
        finally:
            await server.stop(None)

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        cases = [("8.8.8.8", 0, "Cannot assign requested address"),
                 ("nonexistent.invalid", 0, "cannot listen on nonexistent.invalid:0: "),
                 ("127.0.0.1", busy, "Address already in use (is the port in use?)")]  # fmt: skip
        for host, port, said in cases:
            with pytest.raises(ListenError, match=re.escape(said)) as refused:
                asyncio.run(bind(host, port))
            assert ("in use" in str(refused.value)) == (port == busy), refused.value


def test_up_refuses_ports_in_use_before_starting_anything(monkeypatch, capsys):
    """A second `spindle up` on the first one's ports: its gateway could not bind, but its wait for
    SERVING was answered by the first cluster's gateway, so it went on to register and answer
    through the other cluster (or not, by a race) before noticing its own gateway had died."""
    from spindle.cli import main

    def no_child(*args, **kwargs):
        raise AssertionError("a child started although a port is in use")

    monkeypatch.setattr(local.subprocess, "Popen", no_child)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        assert main(["up", "--gateway-port", str(busy), "--http-port", "0"]) == 2
        err = capsys.readouterr().err
        assert f"spindle: error: port {busy} (--gateway-port) on 127.0.0.1 is in use" in err, err
        assert main(["up", "--gateway-port", "0", "--http-port", "0", "--metrics-port", str(busy)]) == 2
        assert f"{busy} (--metrics-port)" in capsys.readouterr().err


def test_up_reads_port_0_as_any_free_port_where_0_means_nothing_else():
    """`up --pod-port 0 --pod-control-port 0 --adapter-port 0` passed 0 on: the gateway and the
    adapter service were told to dial HOST:0. The pod's HTTP and metrics ports keep 0 as "off"."""
    _, parser = command_parser("up")
    flags = ["--pod-port", "--pod-control-port", "--adapter-port", "--pod-http-port", "--metrics-port"]
    args = parser.parse_args([arg for flag in flags for arg in (flag, "0")])
    local._pick_free_ports(args)
    picked = {args.pod_port, args.pod_control_port, args.adapter_port}
    assert 0 not in picked and len(picked) == 3
    assert args.pod_http_port == 0 and args.metrics_port == 0


def test_up_on_an_ipv6_host_picks_its_ports_and_wires_bracketed_addresses():
    """`spindle up --host ::1` was a gaierror traceback (its free ports were picked on an IPv4
    socket), and the services were wired to "::1:PORT", which is no gRPC target."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    _, parser = command_parser("up")
    args = parser.parse_args(["--host", "::1", "--gateway-port", "1", "--http-port", "2"])
    local._pick_free_ports(args)
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", args.pod_port))
    _, service, gateway = local._commands(args, "token")
    assert service[service.index("--pods") + 1] == f"[::1]:{args.pod_control_port}"
    assert gateway[gateway.index("--pods") + 1] == f"[::1]:{args.pod_port}"
    assert gateway[gateway.index("--adapter-service") + 1] == f"[::1]:{args.adapter_port}"
    text = local._try_it(args, "[::1]:1", f"[::1]:{args.adapter_port}")
    assert "http://[::1]:2/v1/chat/completions" in text and f"model pod [::1]:{args.pod_port}" in text


def test_up_prints_commands_naming_the_model_as_the_pod_serves_it():
    """`spindle up --model /models/llama` printed a curl line and an SDK snippet with
    `"model": "/models/llama"`, which the gateway answers 404 (the pod serves it as `llama`)."""
    from model_service.pod.server import served_name

    _, parser = command_parser("up")
    for model, name in (("/models/llama-3.1-8b/", "llama-3.1-8b"), ("/m/tiny.Q4_1.gguf", "tiny.Q4_1"),
                        ("smollm2", "smollm2")):  # fmt: skip
        args = parser.parse_args(["--model", model, "--http-port", "2"])
        local._pick_free_ports(args)
        text = local._try_it(args, "127.0.0.1:1", "127.0.0.1:3")
        assert f'"model": "{name}"' in text and f'model="{name}"' in text, text
        pod = local._commands(args, "token")[0]
        pod_args = command_parser("serve")[1].parse_args(pod[pod.index("serve") + 1 :])
        assert served_name(pod_args) == name


def test_up_refuses_a_bad_lora_before_starting_anything(monkeypatch, capsys, tmp_path):
    """`spindle up --lora bad` (or a directory without an adapter) started the cluster, loaded the
    model and waited for SERVING before it refused the flag; now it refuses at once."""
    from spindle.cli import main

    def no_child(*args, **kwargs):
        raise AssertionError("a child started although --lora is wrong")

    monkeypatch.setattr(local.subprocess, "Popen", no_child)
    ports = ["--gateway-port", "0", "--http-port", "0"]
    for spec, said in (("bad", "--lora takes NAME=DIR, got 'bad'"),
                       (f"a={tmp_path}", f"--lora a={tmp_path}: no adapter_config.json there"),
                       ("a=/x", "--lora a is given twice")):  # fmt: skip
        extra = ["--lora", "a=/y"] if spec == "a=/x" else []
        assert main(["up", *ports, "--lora", spec, *extra]) == 2
        assert said in capsys.readouterr().err


def test_up_refuses_max_tokens_no_request_can_carry_before_starting_anything(capsys):
    """`up --max-tokens 0` was refused by the pod only once the model had loaded, and a value past
    int32 was a protobuf traceback as the first request was built."""
    _, parser = command_parser("up")
    for value, said in (("0", "must be at least 1, got 0"), (str(1 << 31), "must be at most 2147483647")):
        with pytest.raises(SystemExit) as ended:
            parser.parse_args(["--max-tokens", value])
        assert ended.value.code == 2 and said in capsys.readouterr().err
    assert parser.parse_args(["--max-tokens", str((1 << 31) - 1)]).max_tokens == (1 << 31) - 1


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie no init has reaped yet is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_up_s_services_stop_when_up_is_killed():
    """SIGKILL of `spindle up` (the OOM killer, `kill -9`) left its pod, adapter service and gateway
    running as orphans on their ports; its children now get SIGTERM when it dies."""
    import os
    import signal
    import time

    parent = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from spindle import local; "
         "(child,) = local.start_children([[sys.executable, '-c', 'import time; time.sleep(60)']]); "
         "print(child.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    child = int(parent.stdout.readline())
    assert _running(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _running(child):
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the child outlived `spindle up`")
