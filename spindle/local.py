"""`spindle up`: a local cluster. A model pod, the adapter service and a gateway as child
processes on loopback.

It waits until the gateway reports SERVING (which needs a healthy pod, which needs the model
loaded and warmed) and the adapter service too, registers each `--lora` adapter through the
gateway's admin API (the service runs embedded: a local directory for storage, its own memory
for the registry; no Redis or S3), sends one chat request with the base model and one with each
adapter (placed on the pod on demand), prints the answers, and keeps serving until Ctrl-C (or
SIGTERM), when it stops them the way Kubernetes would (SIGTERM, drain).

The ports a caller uses have fixed defaults (the gateway's gRPC 50051 and OpenAI-compatible
HTTP 8000); the internal ones (the pod's, the adapter service's, metrics) are free ports
unless named, so two clusters on one machine only need different gateway ports. All are printed.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapter_service.client import AdaptersClient
from spindle import flagtypes
from spindle.client import Client, chat_request
from spindle.errors import SpindleError
from spindle.openai_api import reasoning_parsers
from spindle.openai_api.tool_parsers import PARSERS
from spindle.peft import lora_specs
from spindle.serving import bind_refusal, host_port, listening_socket, served_model_name

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DEFAULT_PROMPT = "What is the capital of France? Answer in one sentence."


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="the pod's --model [smollm2-135m-instruct]"
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the first request's message")
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="register a PEFT adapter with the adapter service (repeatable); the prompt is also answered "
        "with each",
    )
    parser.add_argument(  # checked now: the pod would refuse it only after the model has loaded
        "--max-tokens", type=flagtypes.at_least(1, 2**31 - 1), default=64, help="for the first request [64]"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address both services listen on [127.0.0.1]")
    parser.add_argument(
        "--gateway-port", type=flagtypes.port, default=50051, help="the gateway's gRPC port [50051]"
    )
    parser.add_argument(
        "--http-port",
        type=flagtypes.port,
        default=8000,
        help="the gateway's OpenAI-compatible HTTP port; 0 = off [8000]",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default="none",
        help="the pod's and gateway's --tool-call-parser (hermes, llama3_json, mistral, pythonic) [none]",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=reasoning_parsers.PARSERS,
        default="none",
        help="the pod's and gateway's --reasoning-parser (deepseek_r1, openai_gptoss, qwen3) [none]",
    )
    parser.add_argument(
        "--pod-port",
        type=flagtypes.port,
        default=None,
        help="the pod's Generation port; 0 = any free one [a free port]",
    )
    parser.add_argument(
        "--pod-control-port",
        type=flagtypes.port,
        default=None,
        help="the pod's ModelControl port; 0 = any free one [a free port]",
    )
    parser.add_argument(
        "--pod-http-port",
        type=flagtypes.port,
        default=None,
        help="the pod's OpenAI-compatible HTTP port [a free port]",
    )
    parser.add_argument(
        "--adapter-port",
        type=flagtypes.port,
        default=None,
        help="the adapter service's; 0 = any free one [a free port]",
    )
    parser.add_argument(
        "--storage-dir",
        default="",
        help="the adapter service's directory of registered adapters [~/.cache/spindle/adapters]",
    )
    parser.add_argument(
        "--metrics-port",
        type=flagtypes.port,
        default=None,
        help="the pod's /metrics port; 0 = off [a free port]",
    )
    parser.add_argument(
        "--log-level", type=flagtypes.log_level, default="WARNING", help="the services' log level [WARNING]"
    )
    parser.add_argument(
        "--startup-timeout", type=flagtypes.seconds, default=600.0, help="seconds to wait for SERVING [600]"
    )
    return parser


_INTERNAL_PORTS = ("pod_port", "pod_control_port", "pod_http_port", "adapter_port", "metrics_port")
# Internal ports for which 0 means nothing to the service (the pod's HTTP and metrics ports take 0
# as "off"): 0 there is read as the OS's "any free port", as a socket's bind reads it. It was passed
# on as is: the gateway or adapter service then refused HOST:0 naming its own flag, not the one
# typed, and `--adapter-port 0` waited out `--startup-timeout`.
_ZERO_IS_ANY = ("pod_port", "pod_control_port", "adapter_port")


def _pick_free_ports(args: argparse.Namespace) -> None:
    """A free port for each internal port the user did not name, or named 0 where 0 means any
    (all held open until every one is picked, so no two are the same)."""
    held = []
    try:
        for name in _INTERNAL_PORTS:
            if getattr(args, name) is None or (name in _ZERO_IS_ANY and getattr(args, name) == 0):
                sock = listening_socket(args.host, 0)  # as the services bind (an IPv4 socket: `::1` failed)
                held.append(sock)
                setattr(args, name, sock.getsockname()[1])
    finally:
        for sock in held:
            sock.close()


# The ports `spindle up` takes, with their flags (the internal ones only when the user named them).
_PORT_FLAGS = {"gateway_port": "--gateway-port", "http_port": "--http-port", "pod_port": "--pod-port",
               "pod_control_port": "--pod-control-port", "pod_http_port": "--pod-http-port",
               "adapter_port": "--adapter-port", "metrics_port": "--metrics-port"}  # fmt: skip


def _ports_in_use(args: argparse.Namespace) -> list[str]:
    """The named ports something already listens on, as "PORT (--FLAG)". Checked before any child
    starts: with a second `spindle up` on the first one's gateway port, this one's wait for its
    gateway was answered by the other cluster's gateway (SERVING), so it could register adapters
    and answer through the other cluster before it noticed its own gateway had exited."""
    busy = []
    for name, flag in _PORT_FLAGS.items():
        port = getattr(args, name)
        if not port:
            continue
        refusal = bind_refusal(args.host, port)
        if refusal is None:
            continue
        if refusal.errno != errno.EADDRINUSE:  # a name that does not resolve, another host's address
            raise SpindleError(f"--host {args.host}: cannot listen there: {refusal.strerror}") from refusal
        busy.append(f"{port} ({flag})")
    return busy


def _check_adapter_dirs(adapters: dict[str, str]) -> None:
    """Refuse a `--lora` directory that is not there before the cluster starts: it was found only
    after the model had loaded and the services were up (minutes on a large model)."""
    for name, path in adapters.items():
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise SpindleError(
                f"--lora {name}={path}: no adapter_config.json there (a PEFT adapter directory)"
            )


def _service_token_file() -> str:
    """A fresh service token for this run, readable by this user only: the pod's control port and
    the adapter service refuse control calls without it, as in a cluster."""
    fd, path = tempfile.mkstemp(prefix="spindle-up-token-")  # mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path


def _commands(args: argparse.Namespace, token_file: str) -> list[list[str]]:
    """The model pod, the adapter service and the gateway, wired to each other on `--host`."""
    me = [sys.executable, "-m", "spindle.cli"]
    pod_cmd = [
        *me, "serve", "--model", args.model, "--host", args.host, "--port", str(args.pod_port),
        "--control-port", str(args.pod_control_port), "--metrics-port", str(args.metrics_port),
        "--http-port", str(args.pod_http_port), "--log-level", args.log_level,
        "--tool-call-parser", args.tool_call_parser, "--reasoning-parser", args.reasoning_parser,
    ]  # fmt: skip
    service_cmd = [
        *me, "adapter-service", "--host", args.host, "--port", str(args.adapter_port),
        "--pods", host_port(args.host, args.pod_control_port), "--base-model", args.model,
        "--metrics-port", "0", "--log-level", args.log_level,
        *(["--storage-dir", args.storage_dir] if args.storage_dir else []),
    ]  # fmt: skip
    gateway_cmd = [
        *me, "gateway", "--host", args.host, "--port", str(args.gateway_port),
        "--http-port", str(args.http_port), "--pods", host_port(args.host, args.pod_port),
        "--tool-call-parser", args.tool_call_parser, "--reasoning-parser", args.reasoning_parser,
        "--allow-unauthenticated", "--health-interval", "0.5",
        "--adapter-service", host_port(args.host, args.adapter_port), "--log-level", args.log_level,
    ]  # fmt: skip
    return [[*cmd, "--control-token-file", token_file] for cmd in (pod_cmd, service_cmd, gateway_cmd)]


def _answer(gateway: str, args: argparse.Namespace) -> None:
    """The first prompt, streamed by the base model and then by each registered adapter."""
    with Client(gateway) as client:
        print(f"> {args.prompt}", flush=True)
        for adapter in [None, *(spec.partition("=")[0] for spec in args.lora)]:
            options = {"adapter": adapter} if adapter else {}
            req = chat_request(
                [{"role": "user", "content": args.prompt}],
                max_tokens=args.max_tokens,
                temperature=0.0,
                **options,
            )
            print(f"[{adapter or 'base model'}] ", end="", flush=True)
            client.generate(req, timeout=120, on_text=lambda d: print(d, end="", flush=True))
            print(flush=True)


def _try_it(args: argparse.Namespace, gateway: str, service: str) -> str:
    """Where everything listens, and commands that work against it as they are."""
    pod, control = host_port(args.host, args.pod_port), host_port(args.host, args.pod_control_port)
    http = f"http://{host_port(args.host, args.http_port)}/v1"
    lines = [
        f"\nServing: gateway {gateway} (gRPC)"
        + (f" and {http} (OpenAI-compatible HTTP)" if args.http_port else ""),
        f"  model pod {pod} (ModelControl {control}, HTTP {args.pod_http_port}, "
        f"metrics {args.metrics_port or 'off'}); adapter service {service}",
        "Try:",
        f'  spindle chat --gateway {gateway} "Tell me a joke."',
    ]
    if args.http_port:
        model = args.lora[0].partition("=")[0] if args.lora else served_model_name(args.model)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a joke."}],
            "max_tokens": 64,
        }
        sdk = (  # double quotes inside, so the shell's single quotes wrap it cleanly
            "from openai import OpenAI; "
            f'client = OpenAI(base_url={json.dumps(http)}, api_key="none"); '
            f"print(client.chat.completions.create(model={json.dumps(model)}, max_tokens=64, "
            f"messages={json.dumps(body['messages'])}).choices[0].message.content)"
        )
        lines += [
            f"  curl -s {http}/chat/completions -H 'Content-Type: application/json' "
            f"-d {shlex.quote(json.dumps(body))}",
            f"  python -c {shlex.quote(sdk)}   # pip install openai",
        ]
    return "\n".join([*lines, "Ctrl-C stops all three."])


def run(args: argparse.Namespace) -> int:
    busy = _ports_in_use(args)
    if busy:
        raise SpindleError(
            f"port {', '.join(busy)} on {args.host} is in use (another `spindle up`?): stop it, or name "
            "other ports"
        )
    _check_adapter_dirs(lora_specs(args.lora))
    _pick_free_ports(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: its terminal closed
        signal.signal(sig, lambda *_: stop.set())
    token_file = _service_token_file()
    children = start_children(_commands(args, token_file))
    gateway, service = host_port(args.host, args.gateway_port), host_port(args.host, args.adapter_port)
    try:
        for target in (gateway, service):
            if not _wait_serving(target, children, stop, args.startup_timeout):
                return 0 if stop.is_set() else 1
        _register(gateway, args.lora)
        _answer(gateway, args)
        print(_try_it(args, gateway, service), file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            if exited := _exited(children):
                print(f"spindle up: {exited}; stopping", file=sys.stderr)
                return 1
        return 0
    except (grpc.RpcError, FileNotFoundError) as e:
        if isinstance(e, FileNotFoundError):
            print(f"spindle up: {e}", file=sys.stderr)
            return 1
        print(f"spindle up: the first request failed: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        _stop(children)
        os.unlink(token_file)


def start_children(commands: list[list[str]]) -> list[subprocess.Popen]:
    """Start each command as a child that Linux sends SIGTERM (a clean drain) when this process
    dies, however it dies. Killed with SIGKILL (the OOM killer, `kill -9`), `spindle up` left its
    three services running as orphans holding the ports, so the next `spindle up` found them in use."""
    if not sys.platform.startswith("linux"):
        return [subprocess.Popen(cmd) for cmd in commands]
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()  # looked up before the fork

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return [subprocess.Popen(cmd, preexec_fn=die_with_parent) for cmd in commands]


def _register(gateway: str, specs: list[str]) -> None:
    """Each NAME=DIR through the admin API; weights already registered under NAME are kept."""
    with AdaptersClient(gateway) as admin:
        for name, path in lora_specs(specs).items():
            try:
                a = admin.register(name, path)
                print(f"spindle up: registered adapter {name} (version {a.version})", file=sys.stderr)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise
                print(f"spindle up: adapter {name} is registered already", file=sys.stderr)


def _wait_serving(
    target: str, children: list[subprocess.Popen], stop: threading.Event, timeout: float
) -> bool:
    print(f"spindle up: waiting for {target} to be SERVING", file=sys.stderr)
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and not stop.is_set():
            if exited := _exited(children):
                print(f"spindle up: {exited} during start-up; its error is above", file=sys.stderr)
                return False
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            stop.wait(0.25)
    if not stop.is_set():
        print(f"spindle up: not SERVING after {timeout:.0f} s", file=sys.stderr)
    return False


def _exited(children: list[subprocess.Popen]) -> str:
    """Which of the children (in `_commands`' order) exited, and how: "" while all run."""
    names = ("the model pod", "the adapter service", "the gateway")
    ended = [
        f"{name} exited (code {c.returncode})"
        for name, c in zip(names, children, strict=True)
        if c.poll() is not None
    ]
    return ", ".join(ended)


def _stop(children: list[subprocess.Popen]) -> None:
    for c in reversed(children):  # the gateway first, so nothing new reaches the pod
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    for c in children:
        try:
            c.wait(timeout=40)
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
