"""The model pod as a real process on loopback (tiny random Llama: token identity is what matters)."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from spindle.v1 import generation_pb2 as pb
from spindle.v1 import model_control_pb2, model_control_pb2_grpc, pod_status_pb2, pod_status_pb2_grpc
from tests.conftest import make_engine
from tests.service_helpers import (
    collect,
    free_port,
    load,
    spawn_pod,
    stub,
    token_request,
    wait_idle,
    wait_serving,
)

Code = grpc.StatusCode
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def pod(tiny_llama, tmp_path_factory):
    metrics_port = free_port()
    service = spawn_pod(
        tiny_llama.name, tmp_path_factory.mktemp("pod"), "pod", "--metrics-port", str(metrics_port)
    )
    service.metrics_port = metrics_port
    yield wait_serving(service)
    assert service.stop() == 0, service.output()


@pytest.fixture(scope="module")
def channel(pod):
    with pod.channel() as ch:
        yield ch


def _engine_tokens(tiny_llama, **request):
    return make_engine(tiny_llama).generate([request])[0].token_ids


def test_tokens_equal_the_engine_run_directly(tiny_llama, channel):
    greedy = {"prompt_token_ids": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    seeded = {**greedy, "temperature": 0.9, "top_p": 0.9, "seed": 1234}
    g = stub(channel)
    tokens, _ = collect(g.Generate(token_request(PROMPT, 12, temperature=0.0)))
    assert tokens == _engine_tokens(tiny_llama, **greedy)
    req = token_request(PROMPT, 12, temperature=0.9, top_p=0.9)
    req.seed = 1234
    tokens, _ = collect(g.Generate(req))
    assert tokens == _engine_tokens(tiny_llama, **seeded)


def test_stream_order_usage_logprobs_and_request_id(channel):
    req = token_request(PROMPT, 6, temperature=0.0)
    req.logprobs, req.request_id = 3, "order-1"
    call = stub(channel).Generate(req)
    msgs = list(call)
    assert dict(call.initial_metadata())["x-request-id"] == "order-1"
    assert all(m.request_id == "order-1" for m in msgs)
    kinds = [m.WhichOneof("kind") for m in msgs]
    assert kinds == ["chunk"] * (len(kinds) - 1) + ["final"]
    chunks = [m.chunk for m in msgs[:-1]]
    assert sum(len(c.token_ids) for c in chunks) == 6
    for c in chunks:
        assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)
        assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in c.logprobs)
    final = msgs[-1].final
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(PROMPT), 6)


def test_unset_sampling_fields_are_defaults_not_zero(tiny_llama, channel):
    # No temperature set: the default 1.0 samples (seeded), it does not silently become greedy 0.
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), max_tokens=8, seed=7)
    req.sampling.ignore_eos = True
    tokens, _ = collect(stub(channel).Generate(req))
    sampled = {"prompt_token_ids": PROMPT, "max_tokens": 8, "seed": 7, "ignore_eos": True}
    assert tokens == _engine_tokens(tiny_llama, **sampled)
    assert tokens != _engine_tokens(tiny_llama, **sampled, temperature=0)


def _long(rid: str) -> pb.GenerateRequest:
    req = token_request(PROMPT, 400, temperature=0.0)
    req.request_id = rid
    return req


def test_abort_ends_the_stream_and_frees_the_blocks(pod, channel):
    g = stub(channel)
    stream = g.Generate(_long("to-abort"))
    first = next(stream)
    assert first.HasField("chunk")
    assert load(pod).kv_blocks_free < load(pod).kv_blocks_total
    g.Abort(pb.AbortRequest(request_id="to-abort"), timeout=5)
    rest = list(stream)
    assert rest[-1].final.finish_reason == pb.FINISH_REASON_ABORT
    assert rest[-1].final.usage.completion_tokens < 400
    wait_idle(pod)


def test_cancel_and_deadline_free_the_blocks(pod, channel):
    g = stub(channel)
    stream = g.Generate(_long("to-cancel"))
    next(stream)
    stream.cancel()
    wait_idle(pod)
    with pytest.raises(grpc.RpcError) as e:
        list(g.Generate(_long("to-expire"), timeout=0.3))
    assert e.value.code() == Code.DEADLINE_EXCEEDED
    wait_idle(pod)


BAD_GENERATE = [
    (pb.GenerateRequest(max_tokens=3), Code.INVALID_ARGUMENT, "no prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), Code.INVALID_ARGUMENT, "prompt_token_ids is empty"),
    (token_request([1, 100000], 3), Code.INVALID_ARGUMENT, "outside"),
    (pb.GenerateRequest(text="needs a tokenizer"), Code.INVALID_ARGUMENT, "tokenizer"),
    (token_request(PROMPT, 3, temperature=-1.0), Code.INVALID_ARGUMENT, "temperature"),
    (token_request(PROMPT, 3, top_p=0.0), Code.INVALID_ARGUMENT, "top_p"),  # an explicit 0 is validated
    (token_request(PROMPT, 0), Code.INVALID_ARGUMENT, "max_tokens"),
    (token_request(PROMPT, 3, top_k=-2), Code.INVALID_ARGUMENT, "top_k"),
    (token_request(PROMPT, 3, num_beams=99), Code.INVALID_ARGUMENT, "num_beams"),
    (token_request([10 + i % 300 for i in range(600)], 3), Code.INVALID_ARGUMENT, "context"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(content="x")])), Code.INVALID_ARGUMENT,
     "role"),
]  # fmt: skip


def _bad(**fields):
    req = token_request(PROMPT, 3)
    for k, v in fields.items():
        setattr(req, k, v)
    return req


BAD_GENERATE += [
    (_bad(logprobs=50), Code.INVALID_ARGUMENT, "logprobs"),
    (_bad(seed=-1), Code.INVALID_ARGUMENT, "seed"),
    (_bad(model="no-such-model"), Code.NOT_FOUND, "not served here"),
    (_bad(adapter=""), Code.INVALID_ARGUMENT, "adapter"),
    (_bad(adapter="no-such-adapter"), Code.NOT_FOUND, "no-such-adapter"),
]


def _processors(bias: dict[int, float] = {}, allowed: list[int] = [], words: list[str] = [], **fields):  # noqa: B006
    """A request with the logits processors' map and repeated fields (setattr cannot set them)."""
    req = token_request(PROMPT, 3, **fields)
    req.sampling.logit_bias.update(bias)
    req.sampling.allowed_token_ids.extend(allowed)
    req.sampling.bad_words.extend(words)
    return req


# the logits processors' values, checked against this model's vocabulary of 320
BAD_GENERATE += [
    (_processors({320: 1.0}), Code.INVALID_ARGUMENT, "outside the vocabulary [0, 320)"),
    (_processors({-5: 1.0}), Code.INVALID_ARGUMENT, "logit_bias has token ids outside"),
    (_processors({5: -250.0}), Code.INVALID_ARGUMENT, "logit_bias values must be in [-100, 100], got -250"),
    (_processors({i: 1.0 for i in range(1025)}), Code.INVALID_ARGUMENT, "at most 1,024"),
    (_processors(allowed=[7, 400]), Code.INVALID_ARGUMENT, "allowed_token_ids has token ids outside"),
    (_processors(min_tokens=4), Code.INVALID_ARGUMENT, "min_tokens must be an integer in [0, max_tokens (3)"),
    (_processors(words=["x"]), Code.INVALID_ARGUMENT, "bad_words need the model's tokenizer"),
    (_processors({5: 1.0}, num_beams=2), Code.INVALID_ARGUMENT, "not supported with num_beams > 1"),
]


def test_bad_input_on_every_rpc_gets_a_code_and_a_message(pod, channel):
    g = stub(channel)
    for req, code, words in BAD_GENERATE:
        with pytest.raises(grpc.RpcError) as e:
            list(g.Generate(req, timeout=10))
        assert e.value.code() == code, (req, e.value.details())
        assert words in e.value.details(), (req, e.value.details())
    for rid, code in (("", Code.INVALID_ARGUMENT), ("never-sent", Code.NOT_FOUND)):
        with pytest.raises(grpc.RpcError) as e:
            g.Abort(pb.AbortRequest(request_id=rid), timeout=5)
        assert e.value.code() == code and e.value.details()
    # a request id that is in flight cannot be reused
    stream = g.Generate(_long("dup"))
    next(stream)
    with pytest.raises(grpc.RpcError) as e:
        list(g.Generate(_long("dup"), timeout=5))
    assert e.value.code() == Code.ALREADY_EXISTS
    stream.cancel()
    with pod.control_channel() as cc:
        control = model_control_pb2_grpc.ModelControlStub(cc)
        with pytest.raises(grpc.RpcError) as e:
            control.Drain(model_control_pb2.DrainRequest(timeout_seconds=-1), timeout=5)
        assert e.value.code() == Code.INVALID_ARGUMENT and "timeout_seconds" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            control.LoadAdapter(model_control_pb2.LoadAdapterRequest(name="x"), timeout=5)
        assert e.value.code() == Code.NOT_FOUND and "unknown adapter 'x'" in e.value.details()
    # and the pod still serves
    tokens, _ = collect(g.Generate(token_request(PROMPT, 3, temperature=0.0), timeout=10))
    assert len(tokens) == 3


def test_list_models_reflection_and_metrics(pod, channel):
    models = stub(channel).ListModels(pb.ListModelsRequest(), timeout=5).models
    assert models[0].kind == pb.MODEL_KIND_BASE and models[0].max_model_len == 512
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    for name in ("spindle.v1.Generation", "spindle.v1.PodStatus", "grpc.health.v1.Health"):
        assert name in services
    assert "spindle.v1.ModelControl" not in services  # on the control port
    text = urllib.request.urlopen(f"http://127.0.0.1:{pod.metrics_port}/metrics", timeout=5).read().decode()
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_count",
        "vllm:generation_tokens_total",
    ):
        assert name in text, name


def test_model_control_is_served_on_the_control_port_only(pod, channel):
    """Generation (the gateway's) and ModelControl (the adapter service's) listen on separate ports,
    so a NetworkPolicy can admit each caller to its own; each port refuses the other's RPCs."""
    with pytest.raises(grpc.RpcError) as e:
        model_control_pb2_grpc.ModelControlStub(channel).GetSlots(
            model_control_pb2.GetSlotsRequest(), timeout=5
        )
    assert e.value.code() == Code.UNIMPLEMENTED
    with pod.control_channel() as cc:
        assert set(ProtoReflectionDescriptorDatabase(cc).get_services()) >= {
            "spindle.v1.ModelControl",
            "grpc.health.v1.Health",
        }
        health = health_pb2_grpc.HealthStub(cc).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:  # nor says its health (it said SERVING)
            health_pb2_grpc.HealthStub(cc).Check(
                health_pb2.HealthCheckRequest(service="spindle.v1.Generation")
            )
        assert e.value.code() == Code.NOT_FOUND
        report = model_control_pb2_grpc.ModelControlStub(cc).GetSlots(
            model_control_pb2.GetSlotsRequest(), timeout=5
        )
        # No adapter resident: one free slot, since the adapter memory has room.
        assert [(s.index, s.adapter) for s in report.slots] == [(0, "")] and report.active_adapter == ""
        for call in (
            lambda: list(stub(cc).Generate(token_request(PROMPT, 3), timeout=5)),
            lambda: pod_status_pb2_grpc.PodStatusStub(cc).GetLoad(pod_status_pb2.GetLoadRequest(), timeout=5),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == Code.UNIMPLEMENTED


def test_sigterm_drains_in_flight_then_exits(tiny_llama, tmp_path):
    service = wait_serving(spawn_pod(tiny_llama.name, tmp_path, "drain", "--drain-timeout", "0.15"))
    results: dict[str, object] = {}

    def run(name: str, max_tokens: int) -> None:
        with service.channel() as ch:
            try:
                results[name] = collect(
                    stub(ch).Generate(token_request(PROMPT, max_tokens, temperature=0.0))
                )[0]
            except grpc.RpcError as e:
                results[name] = e.code()

    # The tiny model decodes ~1 ms a token: four 500-token requests outlast the 0.15 s bound.
    jobs = [("short", 8)] + [(f"long{i}", 500) for i in range(4)]
    threads = [threading.Thread(target=run, args=a) for a in jobs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10

    def all_in() -> bool:  # every job in flight, or the short one done already (a loaded machine)
        in_flight = load(service).requests_in_flight
        return in_flight == len(jobs) or ("short" in results and in_flight == len(jobs) - 1)

    while not all_in() and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    service.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=20)
    assert service.proc.wait(timeout=20) == 0, service.output()
    assert time.monotonic() - started < 8
    assert isinstance(results["short"], list) and len(results["short"]) == 8  # finished within the bound
    assert [results[f"long{i}"] for i in range(4)] == [Code.UNAVAILABLE] * 4  # aborted when it ran out


def test_a_beam_search_larger_than_the_kv_cache_is_out_of_range(tiny_llama, tmp_path):
    """A 200-token prompt fills 50 of this pod's 64 blocks of 4 tokens; 32 beams then need a
    block each beside it. Before, the pod stepped forever doing nothing while that search held
    every block (each stream after it waited until its deadline); now the caller gets
    OUT_OF_RANGE at once naming the limit and by how much (it was RESOURCE_EXHAUSTED, which clients
    and the gateway retry, after the search had stalled twice), nothing leaks, and the next request
    is served exactly."""
    small = wait_serving(spawn_pod(tiny_llama.name, tmp_path, "beams", "--block-size", "4"))
    try:
        with small.channel() as ch:
            prompt = [(7 * i) % 200 + 3 for i in range(200)]
            with pytest.raises(grpc.RpcError) as err:
                collect(stub(ch).Generate(token_request(prompt, 20, num_beams=32), timeout=60))
            assert err.value.code() == Code.OUT_OF_RANGE, err.value.details()
            assert "needs at least 82 K/V blocks of 4 tokens and this engine has 64 (18 too many)" in (
                err.value.details()
            )
            wait_idle(small)
            tokens, _ = collect(stub(ch).Generate(token_request(PROMPT, 8, temperature=0.0)))
        want = {"prompt_token_ids": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert tokens == _engine_tokens(tiny_llama, **want)
    finally:
        assert small.stop() == 0, small.output()
