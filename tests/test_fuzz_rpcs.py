"""Property-based fuzzing of every RPC of every service, through real gRPC to real processes.

Each example is a hostile request (tests/fuzz_strategies.py). Every refusal must be a status the
caller can act on (BAD_INPUT: never UNKNOWN or INTERNAL) with a message; every accepted request must
finish properly; no process dies; afterwards the pod is idle (no KV block held) and a valid request
returns exactly the engine's own tokens. SPINDLE_FUZZ_EXAMPLES sets the examples per RPC
(default 25, so the file stays well under a minute; docs/reliability.md reports a 1,000 run).
"""

from __future__ import annotations

import random

import grpc
import pytest
from hypothesis import given, settings

from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import adapters_pb2_grpc, model_control_pb2_grpc, pod_status_pb2, pod_status_pb2_grpc
from spindle.v1 import generation_pb2 as pb
from tests import fuzz_strategies as fs
from tests.conftest import make_engine
from tests.fuzz_harness import (
    EXAMPLES,
    FUZZ,
    MALFORMED,
    assert_still_serves,
    drive_generate,
    fuzz_raw_bytes,
    note,
    refused_properly,
    registered,
)
from tests.service_helpers import spawn_pod, stub, token_request, wait_serving

Code = grpc.StatusCode
PROMPT = [5, 6, 7, 8, 9]
pytestmark = pytest.mark.usefixtures("fuzz_report")


def test_generate_fuzz_tiny_engine(tiny_llama, tiny_pod):
    """Generation.Generate against a real engine (tiny random Llama: fast, no tokenizer)."""
    rng = random.Random(0)
    reference = (
        make_engine(tiny_llama)
        .generate([{"prompt_token_ids": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}])[0]
        .token_ids
    )

    with tiny_pod.channel() as ch:
        g = stub(ch)

        @FUZZ
        @given(fs.generate_requests(vocab=320, adapters=("a",)))
        def fuzz(req: pb.GenerateRequest) -> None:
            drive_generate(g, "Generate (tiny)", req, rng.choice([None, None, 1, 3]))

        fuzz()
    assert_still_serves(tiny_pod, reference, PROMPT)


@pytest.fixture(scope="module")
def smol_pod(tiny_smollm2, tmp_path_factory):
    """A pod with SmolLM2's tokenizer and chat template (tiny weights: what SmolLM2 would answer
    is no part of what the fuzz checks, and its pod took ~17 s of CPU to start, this one ~7)."""
    logs = tmp_path_factory.mktemp("fuzz_smol")
    service = spawn_pod(tiny_smollm2.name, logs, "smol", "--num-kv-blocks", "256")
    yield wait_serving(service, timeout=300)
    assert service.stop() == 0, service.output()


@pytest.mark.slow  # a pod start, then the fuzz: ~10-20 s on 2 shared cores
def test_generate_fuzz_smollm2(tiny_smollm2, smol_pod):
    """Fewer examples with SmolLM2's tokenizer and chat template: text, chat, stop strings,
    unicode go through the real tokenizer and detokenizer."""
    rng = random.Random(1)
    ids = tiny_smollm2.tokenizer.encode("The capital of France is")
    engine = make_engine(tiny_smollm2)
    reference = engine.generate(
        [{"prompt_token_ids": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True}]
    )
    with smol_pod.channel() as ch:
        g = stub(ch)

        @settings(FUZZ, max_examples=max(10, EXAMPLES // 4))
        @given(fs.generate_requests(vocab=49152))
        def fuzz(req: pb.GenerateRequest) -> None:
            drive_generate(g, "Generate (SmolLM2's tokenizer)", req, rng.choice([None, None, 1, 3]))

        fuzz()
    assert_still_serves(smol_pod, reference[0].token_ids, ids)


def test_abort_list_models_and_get_load_fuzz(tiny_pod):
    with tiny_pod.channel() as ch:
        g, status = stub(ch), pod_status_pb2_grpc.PodStatusStub(ch)

        @FUZZ
        @given(fs.names)
        def fuzz(rid: str) -> None:
            try:
                g.Abort(pb.AbortRequest(request_id=rid), timeout=10)
                note("Abort", "OK")
            except grpc.RpcError as e:
                refused_properly("Abort", e)
            assert g.ListModels(pb.ListModelsRequest(), timeout=10).models[0].max_model_len > 0
            note("ListModels", "OK")
            rep = status.GetLoad(pod_status_pb2.GetLoadRequest(), timeout=10)
            assert rep.kv_blocks_total == 64 and 0 <= rep.kv_blocks_free <= 64
            note("GetLoad", "OK")

        fuzz()


@pytest.mark.parametrize("method", sorted(fs.control_requests))
def test_model_control_fuzz(method, tiny_llama, tiny_pod):
    """Every ModelControl RPC; the pod's configured adapter `a` must survive and still serve."""
    with tiny_pod.control_channel() as cc:
        control = model_control_pb2_grpc.ModelControlStub(cc)
        rpc = f"ModelControl.{method}"

        @FUZZ
        @given(fs.control_requests[method])
        def fuzz(req) -> None:
            try:
                reply = getattr(control, method)(req, timeout=30)
                if method == "FetchAdapterWeights":
                    chunks = list(reply)
                    assert chunks and chunks[-1].last
                note(rpc, "OK")
            except grpc.RpcError as e:
                # a peer that is not there is the peer's fault, not the request's
                refused_properly(rpc, e, frozenset({Code.UNAVAILABLE, Code.DATA_LOSS}))

        fuzz()
    reference = (
        make_engine(tiny_llama)
        .generate([{"prompt_token_ids": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}])[0]
        .token_ids
    )
    assert_still_serves(tiny_pod, reference, PROMPT)


# --- the adapter service ------------------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(fs.adapter_requests))
def test_adapter_service_fuzz(method, adapter_service, lora_dirs, s3):
    from adapter_service.client import AdaptersClient

    kept = registered(adapter_service, "kept", lora_dirs["b"])
    before = s3.keys("kept/")
    with adapter_service.channel() as ch:
        stubs = {"Place": adapters_pb2_grpc.PlacementStub(ch), "Catalog": adapters_pb2_grpc.PlacementStub(ch)}
        call = getattr(stubs.get(method) or adapters_pb2_grpc.AdaptersStub(ch), method)
        rpc = f"Adapters.{method}"

        @FUZZ
        @given(fs.adapter_requests[method].filter(lambda r: getattr(r, "name", "") != "kept"))
        def fuzz(req) -> None:
            try:
                call(req, timeout=30)
                note(rpc, "OK")
            except grpc.RpcError as e:
                refused_properly(rpc, e, frozenset({Code.DATA_LOSS}))

        fuzz()
    with AdaptersClient(adapter_service.address) as client:
        assert client.get("kept").sha256 == kept.sha256
    assert s3.keys("kept/") == before
    assert adapter_service.proc.poll() is None


def test_register_fuzz(adapter_service, s3):
    with adapter_service.channel() as ch:
        admin = adapters_pb2_grpc.AdaptersStub(ch)
        before = s3.keys()

        @FUZZ
        @given(fs.register_streams())
        def fuzz(chunks: list[apb.RegisterChunk]) -> None:
            try:
                admin.Register(iter(chunks), timeout=30)
                raise AssertionError("a fuzzed upload was registered")
            except grpc.RpcError as e:
                refused_properly("Adapters.Register", e)

        fuzz()
    assert s3.keys() == before  # nothing refused was stored
    assert adapter_service.proc.poll() is None


# --- bytes that are not the message at all ------------------------------------------------------

_RAW_METHODS = [
    ("pod", "/spindle.v1.Generation/Generate", "unary_stream"),
    ("pod", "/spindle.v1.Generation/Abort", "unary_unary"),
    ("pod", "/spindle.v1.PodStatus/GetLoad", "unary_unary"),
    ("control", "/spindle.v1.ModelControl/LoadAdapter", "unary_unary"),
    ("control", "/spindle.v1.ModelControl/FetchAdapterWeights", "unary_stream"),
    ("adapters", "/spindle.v1.Adapters/Register", "stream_unary"),
    ("adapters", "/spindle.v1.Adapters/Get", "unary_unary"),
    ("adapters", "/spindle.v1.Placement/Place", "unary_unary"),
]


@pytest.mark.parametrize(("where", "path", "kind"), _RAW_METHODS)
def test_malformed_protobuf_bytes_are_invalid_argument(where, path, kind, tiny_pod, adapter_service):
    """Raw bytes that do not parse as the request message (wrong wire types, truncated varints,
    invalid UTF-8 in a string): INVALID_ARGUMENT, not the library's UNKNOWN."""
    target = {"pod": tiny_pod.address, "control": tiny_pod.control_address}.get(
        where, adapter_service.address
    )
    with grpc.insecure_channel(target) as ch:
        fuzz_raw_bytes(ch, path, kind)


def _reverse_offsets(header: dict) -> None:
    from tests.test_upload_hardening import _first

    _first(header)["data_offsets"].reverse()


def _string_offsets(header: dict) -> None:
    from tests.test_upload_hardening import _first

    _first(header).update(data_offsets=["0", "1"])


def test_lying_uploads_are_refused_before_anything_is_stored(adapter_service, lora_dirs, s3, redis_url):
    """Each attack through the real Register RPC: refused, and neither S3 nor the Redis index moved."""
    import hashlib
    import json

    import redis

    from tests.test_upload_hardening import _with_header

    config = json.loads((lora_dirs["a"] / "adapter_config.json").read_text())
    good = (lora_dirs["a"] / "adapter_model.safetensors").read_bytes()
    attacks = {
        "../../etc/x": (config, good, Code.INVALID_ARGUMENT),
        "rank-lie": ({**config, "r": config["r"] + 1}, good, Code.INVALID_ARGUMENT),
        "target-lie": ({**config, "target_modules": ["o_proj"]}, good, Code.INVALID_ARGUMENT),
        "offset-lie": (config, _with_header(good, _reverse_offsets), Code.INVALID_ARGUMENT),
        "string-offsets": (config, _with_header(good, _string_offsets), Code.INVALID_ARGUMENT),
        "pickle": (config, b"\x80\x04\x95" + good[3:], Code.INVALID_ARGUMENT),
        "oversized": (config, good + b"\0" * 2_000_000, Code.OUT_OF_RANGE),
    }  # fmt: skip
    index = redis.Redis.from_url(redis_url)
    before = (s3.keys(), sorted(index.hkeys("spindle:adapters:index")))
    with adapter_service.channel() as ch:
        admin = adapters_pb2_grpc.AdaptersStub(ch)
        for name, (cfg, data, code) in attacks.items():
            cfg_bytes, digest = json.dumps(cfg).encode(), hashlib.sha256(data).hexdigest()
            header = apb.RegisterHeader(
                name=name, config_json=cfg_bytes, total_bytes=len(data), sha256=digest
            )
            chunks = [apb.RegisterChunk(header=header), apb.RegisterChunk(data=data)]
            with pytest.raises(grpc.RpcError) as e:
                admin.Register(iter(chunks), timeout=30)
            assert e.value.code() == code and e.value.details(), (name, e.value.details())
        # truncated (fewer bytes than announced) and checksum mismatch
        for total, digest in ((len(good) + 10, hashlib.sha256(good).hexdigest()), (len(good), "0" * 64)):
            cfg_bytes = json.dumps(config).encode()
            header = apb.RegisterHeader(name="cut", config_json=cfg_bytes, total_bytes=total, sha256=digest)
            with pytest.raises(grpc.RpcError) as e:
                admin.Register(
                    iter([apb.RegisterChunk(header=header), apb.RegisterChunk(data=good)]), timeout=30
                )
            assert e.value.code() in (Code.INVALID_ARGUMENT, Code.DATA_LOSS), e.value.details()
    assert (s3.keys(), sorted(index.hkeys("spindle:adapters:index"))) == before


def test_bad_input_regressions(tiny_pod):
    """The fuzz's findings, one named case each (see docs/reliability.md)."""
    from spindle.v1 import model_control_pb2 as mc

    with tiny_pod.channel() as ch:
        for rid in ("é", "a b", "x\n", "y" * 257):  # was INTERNAL "Invalid metadata"
            req = token_request(PROMPT, 2, temperature=0.0)
            req.request_id = rid
            with pytest.raises(grpc.RpcError) as e:
                list(stub(ch).Generate(req, timeout=10))
            assert e.value.code() == Code.INVALID_ARGUMENT and "request_id" in e.value.details()
        for raw in MALFORMED:  # was UNKNOWN "Unexpected DecodeError"
            with pytest.raises(grpc.RpcError) as e:
                list(ch.unary_stream("/spindle.v1.Generation/Generate")(raw, timeout=10))
            assert e.value.code() == Code.INVALID_ARGUMENT and "protobuf" in e.value.details()
    with tiny_pod.control_channel() as cc:
        control = model_control_pb2_grpc.ModelControlStub(cc)
        for path in ("/no/such/dir", "nul\0byte"):  # was UNKNOWN (FileNotFoundError, ValueError)
            with pytest.raises(grpc.RpcError) as e:
                control.Rotate(mc.RotateRequest(name="a", path=path, sha256="0" * 64), timeout=10)
            assert e.value.code() == Code.NOT_FOUND and "cannot read" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # was INTERNAL (OSError: File name too long)
            control.LoadAdapter(mc.LoadAdapterRequest(name="long", path="x" * 5000), timeout=10)
        assert e.value.code() == Code.INVALID_ARGUMENT and "cannot read" in e.value.details()
