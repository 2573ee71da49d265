"""What the RPC fuzz tests share (tests/test_fuzz_rpcs.py, tests/test_fuzz_gateway.py): the
example budget, the outcome tally printed for docs/reliability.md, the checks on a refusal, one
Generate call driven to its end, bytes that are not a message, and the real processes fuzzed (a
tiny pod, the adapter service in front of it). A pytest plugin (tests/conftest.py)."""

from __future__ import annotations

import collections
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import generation_pb2 as pb
from tests import fuzz_strategies as fs
from tests.adapter_helpers import aws_env
from tests.service_helpers import collect, spawn, spawn_pod, stub, token_request, wait_idle, wait_serving

Code = grpc.StatusCode
EXAMPLES = int(os.environ.get("SPINDLE_FUZZ_EXAMPLES", "25"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
OUTCOMES: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

MALFORMED = [
    b"\x12\x03\xff\xfe\xfd",  # field 2 (text / name), invalid UTF-8
    b"\x0a\x02\xc3\x28",  # field 1 string, invalid UTF-8
    b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # a varint past 10 bytes
    b"\x0a\x7f",  # a length past the end
    b"\x0f",  # wire type 7
]


@pytest.fixture(scope="module")
def fuzz_report():
    """Print what each RPC answered (for docs/reliability.md) when the module ends; run with -s."""
    yield
    for rpc, counts in sorted(OUTCOMES.items()):
        print(f"FUZZ {rpc}: {sum(counts.values())} calls {dict(counts.most_common())}")
    OUTCOMES.clear()


def note(rpc: str, outcome: str) -> str:
    OUTCOMES[rpc][outcome] += 1
    return outcome


def refused_properly(
    rpc: str, e: grpc.RpcError, also: frozenset = frozenset(), silent: frozenset = frozenset()
) -> str:
    """Tally the refusal; it must be a code the caller can act on, with a message (`silent`:
    codes gRPC's own transport may send without one, e.g. for metadata over its size limit)."""
    note(rpc, e.code().name)
    assert e.code() in fs.BAD_INPUT | also, f"{rpc}: {e.code()} {e.details()!r}"
    assert e.details() or e.code() in silent, f"{rpc}: {e.code()} without a message"
    # the answer's own trailers too large: its code was lost (unless the test sent huge metadata)
    assert "metadata size exceeds" not in e.details() or e.code() in silent, f"{rpc}: {e.details()}"
    return e.code().name


def drive_generate(
    g,
    rpc: str,
    req: pb.GenerateRequest,
    cancel_after: int | None,
    also: frozenset = frozenset(),
    silent: frozenset = frozenset(),
    **call,
) -> str:
    """Send one request (`call`: timeout, metadata); an accepted one is read to its Final, or
    cancelled after `cancel_after` chunks. Returns the outcome: OK, CANCELLED or the code's name."""
    try:
        stream = g.Generate(req, **{"timeout": 60, **call})
        for n, msg in enumerate(stream, 1):
            if msg.HasField("final"):
                assert msg.final.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                return note(rpc, "OK")
            assert msg.HasField("chunk")
            if cancel_after is not None and n >= cancel_after:
                stream.cancel()
                return note(rpc, "OK (cancelled)")
        raise AssertionError(f"{rpc}: stream ended without a Final")
    except grpc.RpcError as e:
        if e.code() == Code.CANCELLED and cancel_after is not None:
            return note(rpc, "OK (cancelled)")
        return refused_properly(rpc, e, also, silent)


def fuzz_raw_bytes(channel: grpc.Channel, path: str, kind: str, **call) -> None:
    """Send bytes that are mostly not the method's message: INVALID_ARGUMENT, not UNKNOWN (those
    that happen to parse may be answered, or refused as bad input)."""
    send = getattr(channel, kind)(path)
    rpc = f"raw {path}"

    @FUZZ
    @given(st.one_of(st.binary(min_size=1, max_size=64), st.sampled_from(MALFORMED)))
    def fuzz(raw: bytes) -> None:
        try:
            reply = send(iter([raw]) if kind == "stream_unary" else raw, **{"timeout": 10, **call})
            if kind == "unary_stream":
                list(reply)
            note(rpc, "OK (parsed)")
        except grpc.RpcError as e:
            refused_properly(rpc, e)

    fuzz()


def assert_still_serves(pod, reference: list[int], ids: list[int], adapter: str = "") -> None:
    """The process is alive, nothing is held, and a valid request gets exactly the engine's tokens."""
    assert pod.proc.poll() is None, pod.output()
    wait_idle(pod, timeout=60)
    with pod.channel() as ch:
        req = token_request(ids, len(reference), temperature=0.0)
        if adapter:
            req.adapter = adapter
        tokens, _ = collect(stub(ch).Generate(req, timeout=60))
    assert tokens == reference


@pytest.fixture(scope="module")
def tiny_pod(tiny_llama, lora_dirs, tmp_path_factory):
    """A pod over the tiny random Llama (a real engine: fast, no tokenizer), adapter `a`, 2 slots."""
    logs = tmp_path_factory.mktemp("fuzz_pod")
    service = spawn_pod(tiny_llama.name, logs, "pod", "--max-loras", "2", "--lora", f"a={lora_dirs['a']}")
    yield wait_serving(service)
    assert service.stop() == 0, service.output()


@pytest.fixture(scope="module")
def adapter_service(tiny_llama, tiny_pod, redis_url, s3, tmp_path_factory):
    """The adapter service over a real redis-server and moto's S3, placing on `tiny_pod`."""
    import redis

    redis.Redis.from_url(redis_url).flushall()
    args = [
        "--pods", tiny_pod.control_address, "--redis-url", redis_url, "--s3-bucket", s3.bucket,
        "--s3-endpoint-url", s3.endpoint, "--s3-region", "us-east-1", "--base-model", tiny_llama.name,
        "--metrics-port", "0", "--max-adapter-bytes", "2000000", "--max-lora-rank", "16",
    ]  # fmt: skip
    service = spawn("adapter-service", args, tmp_path_factory.mktemp("fuzz_svc"), "svc", env=aws_env())
    yield wait_serving(service)
    assert service.stop() == 0, service.output()


def registered(adapter_service, name: str, directory) -> apb.Adapter:
    """`name` registered (from `directory`) in the service, or as it already was."""
    from adapter_service.client import AdaptersClient

    with AdaptersClient(adapter_service.address) as client:
        known = {a.name: a for a in client.list()}
        return known.get(name) or client.register(name, directory)
