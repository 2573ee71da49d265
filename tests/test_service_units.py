"""Pure parts of the services: routing scores, prefix hashes, API keys, env flags, wire mapping."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import random
import re
import subprocess
import sys
import time

import grpc
import pytest

from gateway import prefix, router
from gateway.auth import ApiKeys, AuthError
from model_service.errors import InvalidRequestError
from model_service.pod import wire
from spindle import envflags
from spindle.v1 import generation_pb2 as pb
from tests.service_helpers import ROOT


def test_adapter_affinity_levels_follow_the_inference_extension():
    has = {"x", "y", "z"}
    resident = router.Candidate("a", resident_adapters={"x"}, max_adapters=2, available_adapters=has)
    room = router.Candidate("b", resident_adapters={"y"}, max_adapters=2, available_adapters=has)
    waiting = router.Candidate(
        "c", resident_adapters={"y", "z"}, waiting_adapters={"x"}, max_adapters=2, available_adapters=has
    )
    full = router.Candidate("d", resident_adapters={"y", "z"}, max_adapters=2, available_adapters=has)
    no_lora = router.Candidate("e")
    scores = [router.adapter_score(p, "x") for p in (resident, room, waiting, full, no_lora)]
    assert scores == [1.0, 0.75, 0.6, 0.0, 0.0]  # room: a load from disk, half the slots free
    assert router.adapter_score(full, None) == 1.0  # base-model requests fit anywhere
    assert router.choose([full, waiting, room, resident], "x", {}) == "a"
    # A pod that does not have the adapter at all is never chosen for it, however idle.
    assert router.choose([no_lora, full], "x", {}) == "d"
    assert router.choose([no_lora], "x", {}) is None
    assert router.choose([no_lora], None, {}) == "e"


def test_queue_kv_and_prefix_scores_combine():
    idle, busy = router.Candidate("idle"), router.Candidate("busy", num_waiting=8, kv_usage=0.9)
    assert router.choose([idle, busy], None, {}) == "idle"
    assert router.queue_scores([idle, busy, router.Candidate("mid", num_waiting=4)]) == {
        "idle": 1.0,
        "busy": 0.0,
        "mid": 0.5,
    }
    # prefix locality outweighs a small KV difference
    warm, cold = router.Candidate("warm", kv_usage=0.3), router.Candidate("cold", kv_usage=0.1)
    assert router.choose([warm, cold], None, {"warm": 1.0}) == "warm"
    # exact ties are broken at random, so equal pods share the load
    picks = {
        router.choose([router.Candidate("p"), router.Candidate("q")], None, {}, rng=random.Random(i))
        for i in range(20)
    }
    assert picks == {"p", "q"}
    assert router.choose([], None, {}) is None
    # A full prefix hit on a pod with one more waiting request ties with the idle pod: the tie
    # goes to the prefix (it was a coin flip: the gateway test's sequential turns split 3 / 3)
    holder, other = router.Candidate("holder", num_waiting=1), router.Candidate("other")
    scores = router.score([holder, other], None, {"holder": 1.0})
    assert scores["holder"] == scores["other"]
    picks = {router.choose([holder, other], None, {"holder": 1.0}, rng=random.Random(i)) for i in range(20)}
    assert picks == {"holder"}


def test_a_burst_between_load_polls_is_spread_by_the_gateways_own_stream_counts():
    """Load reports are a poll apart; the streams the gateway opened since a pod's report count as
    waiting there, so a burst fills the emptier pod up to the other's depth, then alternates."""
    import asyncio
    import contextlib

    from gateway.pods import Pod, PodPool, static_discovery
    from gateway.server import GatewayService
    from spindle.v1 import pod_status_pb2

    def open_burst(gateway: GatewayService, streams: contextlib.ExitStack, n: int) -> None:
        for i in range(n):
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[i, i + 1]))
            pod = gateway._choose(req, prefix.block_hashes(req), set())
            streams.enter_context(pod.streaming())

    async def burst() -> list[list[int]]:
        pool = PodPool(static_discovery([]))
        for address, waiting in (("a:1", 0), ("b:1", 2)):
            pool.pods[address] = Pod(address, [])
            pool.pods[address].healthy = True
            pool.pods[address].load = pod_status_pb2.PodLoad(num_waiting=waiting)
        gateway, seen = GatewayService(pool, None), []
        with contextlib.ExitStack() as streams:
            open_burst(gateway, streams, 8)
            seen.append([p.in_flight for p in pool.pods.values()])
            for p in pool.pods.values():  # a poll: the reports now count every open stream
                p.load, p.in_flight_at_report = pod_status_pb2.PodLoad(num_waiting=5), p.in_flight
            open_burst(gateway, streams, 4)
            seen.append([p.in_flight for p in pool.pods.values()])
        seen.append([p.in_flight for p in pool.pods.values()])
        await pool.close()
        return seen

    assert asyncio.run(burst()) == [[5, 3], [7, 5], [0, 0]]
    assert router.queue_scores([router.Candidate("a", 1), router.Candidate("b", 0, unreported=3)]) == {
        "a": 1.0,
        "b": 0.0,
    }


def test_a_pod_gone_from_discovery_is_closed_only_when_its_streams_end():
    """A terminating Kubernetes pod leaves its Service at once and drains; the gateway closed
    its channels on the next discovery, which cancelled the streams open there under the gateway:
    their callers' streams hung until their deadlines."""
    import asyncio

    from gateway.pods import RETIRE_POLL_S, PodPool, static_discovery

    async def scenario() -> list[bool]:
        addresses = ["127.0.0.1:1", "127.0.0.1:2"]  # nothing listens: the health checks fail fast
        pool = PodPool(static_discovery(addresses), timeout=0.2, discovery_interval=0)
        await pool.refresh()
        gone = pool.pods[addresses.pop()]
        closed: list[bool] = []
        stream = gone.streaming()
        stream.__enter__()
        await pool.refresh()
        await asyncio.sleep(3 * RETIRE_POLL_S)
        closed.append(gone.relay_channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN)
        stream.__exit__(None, None, None)
        await asyncio.sleep(3 * RETIRE_POLL_S)
        closed.append(gone.relay_channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN)
        await pool.close()
        return closed

    assert asyncio.run(scenario()) == [False, True]


def test_the_gateway_names_the_request_only_once_its_pod_has_it():
    """The gateway sent x-request-id as it opened the pod's call: a caller's Abort on seeing it
    could reach the pod before the request did, and was NOT_FOUND for a request in flight."""
    import asyncio

    from gateway.pods import Pod, PodPool, static_discovery
    from gateway.server import GatewayService
    from spindle.openai_api.context import HttpCallContext

    class PodCall:
        """A pod's Generate call whose headers (the pod has the request) come a moment later."""

        def __init__(self) -> None:
            self.pod_has_it = False

        async def initial_metadata(self) -> tuple:
            await asyncio.sleep(0.05)
            self.pod_has_it = True
            return ()

        def __aiter__(self):
            return self._messages()

        async def _messages(self):
            final = pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_STOP))
            yield final.SerializeToString()

        def cancel(self) -> None:
            pass

    class Caller(HttpCallContext):
        async def send_initial_metadata(self, metadata) -> None:
            named_early.append(not call.pod_has_it)

    async def relay() -> None:
        pool = PodPool(static_discovery([]))
        pod = pool.pods["a:1"] = Pod("a:1", [])
        pod.healthy, pod.generate_raw = True, lambda *a, **kw: call
        async for _ in GatewayService(pool, None).Generate(pb.GenerateRequest(text="hi"), Caller({})):
            pass
        await pool.close()

    call, named_early = PodCall(), []
    asyncio.run(relay())
    assert named_early == [False]


def test_a_relayed_stream_resumes_after_what_the_caller_has():
    from gateway.relay import Relayed

    req = pb.GenerateRequest(request_id="r", text="hi", max_tokens=9)
    req.resume.output_token_ids.extend([1, 2])  # the caller resumed it itself, with 3 characters
    req.resume.text_chars = 3
    stream = Relayed(req)
    assert stream.next_request() is req  # nothing relayed yet: the request as it came
    for ids, text in (([5], "ab"), ([6, 7], ""), ([], "é!")):
        chunk = pb.Chunk(token_ids=ids, text=text)
        stream.add(pb.GenerateResponse(request_id="r", chunk=chunk).SerializeToString())
    resumed = stream.next_request()
    assert list(resumed.resume.output_token_ids) == [1, 2, 5, 6, 7] and resumed.resume.text_chars == 7
    assert (resumed.text, resumed.max_tokens) == ("hi", 9) and list(req.resume.output_token_ids) == [1, 2]
    assert stream.final() is None
    stream.add(pb.GenerateResponse(final=pb.Final(finish_reason=pb.FINISH_REASON_LENGTH)).SerializeToString())
    assert stream.next_request() is None and stream.final().finish_reason == pb.FINISH_REASON_LENGTH


def test_prefix_hashes_chain_and_the_index_scores_leading_blocks():
    base = "x" * (prefix.BLOCK_BYTES * 4)
    a = prefix.block_hashes(pb.GenerateRequest(text=base))
    b = prefix.block_hashes(pb.GenerateRequest(text=base[:200] + "y" * (len(base) - 200)))  # block 3 differs
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]  # same leading blocks, same hashes
    assert prefix.block_hashes(pb.GenerateRequest(text=base, adapter="lora")) != a  # adapter seeds the chain
    assert prefix.block_hashes(pb.GenerateRequest(text="short")) == []
    index = prefix.PrefixIndex(capacity=100)
    index.record(a, "pod1")
    index.record(a[:2], "pod2")
    assert index.match(a, ["pod1", "pod2", "pod3"]) == {"pod1": 1.0, "pod2": 0.5, "pod3": 0.0}
    assert index.match(b, ["pod1"]) == {"pod1": 0.75}
    index.forget_pod("pod1")
    assert index.match(a, ["pod1", "pod2"]) == {"pod1": 0.0, "pod2": 0.5}
    small = prefix.PrefixIndex(capacity=3)
    small.record(a, "pod1")
    assert len(small) == 3


def test_api_keys_from_a_file_or_a_secret_directory(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nalice k1 *\nbob k2 -\ncarol k3 a,b\n")
    api = ApiKeys(keys)
    assert api.authenticate((("authorization", "Bearer k1"),)).adapters is None
    assert api.authenticate((("x-api-key", "k2"),)).adapters == frozenset()
    carol = api.authenticate((("authorization", "Bearer k3"),))
    assert carol.may_use("a") and not carol.may_use("c") and carol.may_use(None)
    for md in ((), (("authorization", "Bearer nope"),)):
        with pytest.raises(AuthError) as e:
            api.authenticate(md)
        assert e.value.unauthenticated
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "team-a").write_text("dave k4 *\n")
    (secret / "..data").mkdir()  # Kubernetes' own entries are skipped
    assert ApiKeys(secret).authenticate((("x-api-key", "k4"),)).name == "dave"
    (secret / "team-a").write_text("dave k5 *\n")  # rotated: re-read without a restart
    api2 = ApiKeys(secret)
    (secret / "team-a").write_text("erin k6 *\n")
    assert api2.reload() and api2.authenticate((("x-api-key", "k6"),)).name == "erin"
    bad = tmp_path / "bad"
    bad.write_text("only-two fields\n")
    with pytest.raises(ValueError, match="bad:1"):
        ApiKeys(bad)


def test_api_keys_admin_scope_is_an_optional_fourth_column(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("ops k1 * admin\nuser k2 *\n")
    api = ApiKeys(keys)
    assert api.authenticate((("x-api-key", "k1"),)).admin
    assert not api.authenticate((("x-api-key", "k2"),)).admin  # three columns: as before, no admin
    keys.write_text("ops k1 * root\n")
    with pytest.raises(ValueError, match="unknown scope"):
        ApiKeys(keys)


def test_every_flag_reads_its_environment_variable():
    p = argparse.ArgumentParser()
    p.add_argument("--max-num-seqs", type=int, default=256, help="x")
    p.add_argument("--allow-unauthenticated", action="store_true")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--stop", action="append", default=None)
    env = {
        "SPINDLE_MAX_NUM_SEQS": "8",
        "SPINDLE_ALLOW_UNAUTHENTICATED": "true",
        "SPINDLE_ENABLE_PREFIX_CACHING": "0",
        "SPINDLE_STOP": "a,b",
    }
    envflags.apply_env(p, env)
    args = p.parse_args([])
    assert (args.max_num_seqs, args.allow_unauthenticated, args.enable_prefix_caching) == (8, True, False)
    assert args.stop == ["a", "b"]
    assert p.parse_args(["--max-num-seqs", "3"]).max_num_seqs == 3  # the flag wins
    assert "SPINDLE_MAX_NUM_SEQS" in p.format_help()


def test_wire_unset_fields_keep_engine_defaults_and_set_zeros_are_validated():
    req = pb.GenerateRequest(text="hi")
    params = wire.engine_request(req)["params"]
    assert (params.temperature, params.top_p, params.max_tokens, params.seed) == (1.0, 1.0, 256, None)
    req.sampling.temperature = 0.0
    req.max_tokens = 5
    req.sampling.early_stopping = pb.EARLY_STOPPING_NEVER
    params = wire.engine_request(req)["params"]
    assert (params.temperature, params.max_tokens, params.early_stopping) == (0.0, 5, "never")
    req.sampling.top_p = 0.0
    with pytest.raises(InvalidRequestError, match="top_p"):
        wire.engine_request(req)
    with pytest.raises(InvalidRequestError, match="no prompt"):
        wire.engine_request(pb.GenerateRequest())


@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_off_is_spelled_alike_on_grpc_and_http(top_k):
    # Regression: the HTTP front took vLLM's top_k=-1 for "off" while gRPC refused it.
    from spindle.openai_api.requests import chat_request

    http, _ = chat_request({"messages": [{"role": "user", "content": "hi"}], "top_k": top_k}, set())
    grpc_req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_k=top_k))
    for req in (http, grpc_req):
        assert not wire.engine_request(req)["params"].truncates
    with pytest.raises(InvalidRequestError, match="top_k"):
        wire.engine_request(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_k=-2)))


@pytest.mark.parametrize("top", [-1, 21])
def test_a_chats_top_logprobs_out_of_range_is_refused_naming_top_logprobs(top):
    # Regression: it reached the engine as `logprobs` and came back "logprobs must be an integer in
    # [0, 20], got 21" with no `param`, naming a field the caller had set to `true`.
    from spindle.openai_api.errors import ApiError
    from spindle.openai_api.requests import chat_request

    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": top}
    with pytest.raises(ApiError) as refused:
        chat_request(body, set())
    assert refused.value.param == "top_logprobs" and "top_logprobs" in str(refused.value)
    body["top_logprobs"] = 20
    assert chat_request(body, set())[0].logprobs == 20


def test_an_unknown_role_is_refused_naming_developer_among_the_roles_served():
    # Regression: the message listed "system, user, assistant, tool", though `developer` is served.
    from spindle.openai_api.errors import ApiError
    from spindle.openai_api.requests import chat_request

    with pytest.raises(ApiError, match="developer"):
        chat_request({"messages": [{"role": "narrator", "content": "hi"}]}, set())
    chat_request({"messages": [{"role": "developer", "content": "Be brief."}]}, set())


def test_dns_discovery_turns_every_address_into_a_pod():
    import asyncio

    from gateway.pods import dns_discovery

    pods = asyncio.run(dns_discovery("localhost:50052")())
    assert "127.0.0.1:50052" in pods or "[::1]:50052" in pods
    with pytest.raises(ValueError, match="HOST:PORT"):
        dns_discovery("no-port")


@pytest.mark.parametrize("address", ["::1:50052", "fd00::5", "fd00:10:244::7:50051"])
def test_an_unbracketed_ipv6_address_is_refused_as_no_host_port(address):
    """`--pods ::1:50052` (or `fd00::5`) was taken as host "::1" port 50052, but gRPC reads an
    unbracketed IPv6 target as an address on port 443: the gateway and the adapter service
    health-checked a pod they could never reach, forever. The message says to bracket it."""
    from gateway.pods import check_target, static_discovery

    with pytest.raises(ValueError, match=r"in brackets: \[::1\]:PORT"):
        static_discovery([address])
    with pytest.raises(ValueError, match="--advertise-address"):
        check_target(address, "--advertise-address")
    static_discovery(["[::1]:50052", "[fd00:10:244::7]:50051", "pod-0.pods:50051"])


def test_dns_discovery_of_a_dual_stack_service_counts_each_pod_once(monkeypatch):
    """A dual-stack headless Service (or `localhost`) answers an IPv4 and an IPv6 address for every
    pod: both were taken, so each pod was two pods to route to and place adapters on."""
    import asyncio
    import socket

    from gateway.pods import dns_discovery

    records = [(socket.AF_INET, "10.0.0.7"), (socket.AF_INET6, "fd00::7"), (socket.AF_INET, "10.0.0.8"),
               (socket.AF_INET6, "fd00::8")]  # fmt: skip

    async def resolve(self, host, port, **_):
        answer = records if host == "pods" else [r for r in records if r[0] == socket.AF_INET6]
        return [(family, socket.SOCK_STREAM, 6, "", (address, port)) for family, address in answer]

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", resolve)
    assert asyncio.run(dns_discovery("pods:50051")()) == ["10.0.0.7:50051", "10.0.0.8:50051"]
    assert asyncio.run(dns_discovery("pods-v6:50051")()) == ["[fd00::7]:50051", "[fd00::8]:50051"]


def test_dns_discovery_of_a_bracketed_ipv6_literal_finds_its_pod():
    """`--pods-dns [::1]:50052` asked the resolver for the name "[::1]", which none resolves: the
    pool stayed empty and each discovery logged a failure."""
    import asyncio

    from gateway.pods import dns_discovery

    assert asyncio.run(dns_discovery("[::1]:50052")()) == ["[::1]:50052"]


def test_the_gateway_client_and_dispatcher_import_no_torch():
    code = (
        "import spindle.cli, gateway.server, spindle.client, spindle.local, spindle.grpc_status; import sys; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr


def test_importing_the_engine_changes_no_process_setting():
    """Process-wide settings are made at start-up (model_service/startup.py), never on import."""
    code = (
        "import os, model_service.engine.engine, model_service.pod.server, torch; "
        "assert 'OMP_WAIT_POLICY' not in os.environ; assert torch.backends.cuda.cudnn_sdp_enabled(); "
        "from model_service.startup import configure_process; configure_process(); "
        "assert os.environ['OMP_WAIT_POLICY'] == 'PASSIVE' and not torch.backends.cuda.cudnn_sdp_enabled()"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_the_engine_and_the_bench_fake_offer_the_engine_handle(tiny_llama):
    """Everything the model pod uses of an engine (EngineHandle) exists, with the same parameters,
    on the real Engine and on the fake engine of bench/fake_engine.py."""
    from bench.fake_engine import FakeFastEngine
    from model_service.engine.config import EngineConfig
    from model_service.engine.handle import EngineHandle
    from model_service.models.tokenizer import Tokenizer
    from tests.conftest import make_engine

    members = {n for n in vars(EngineHandle) if not n.startswith("_")}
    attributes = {"config", "max_model_len", "vocab_size", "adapter_memory", "tokenizer"}
    methods = {"add_request", "step", "abort", "has_unfinished", "stats", "list_adapters", "submit_control"}
    methods.add("on_lost")
    assert members == attributes | methods
    for impl in (make_engine(tiny_llama), FakeFastEngine(0.0)):
        assert isinstance(impl.config, EngineConfig)
        assert isinstance(impl.max_model_len, int) and isinstance(impl.vocab_size, int)
        assert impl.tokenizer is None or isinstance(impl.tokenizer, Tokenizer)
        memory = impl.adapter_memory
        assert isinstance(memory.memory_used_bytes, int) and isinstance(memory.memory_capacity_bytes, int)
        for name in methods:
            want = inspect.signature(getattr(EngineHandle, name)).parameters
            got = inspect.signature(getattr(type(impl), name)).parameters
            assert list(got) == list(want), (type(impl).__name__, name)
            assert [p.kind for p in got.values()] == [p.kind for p in want.values()], name


def test_engine_errors_map_to_codes_and_a_bug_is_internal():
    import grpc

    from model_service.errors import BeyondCapacityError, CapacityError, ModelLoadError, NotFoundError
    from model_service.lora.adapter import AdapterError
    from model_service.lora.pool import AdapterBusyError, AdapterNotFoundError, SlotsBusyError
    from model_service.pod.status import status_for

    code = grpc.StatusCode
    cases = [
        (NotFoundError("unknown adapter 'x'"), code.NOT_FOUND),
        (AdapterNotFoundError("not resident"), code.NOT_FOUND),
        (AdapterBusyError("pinned"), code.FAILED_PRECONDITION),
        (SlotsBusyError("all busy"), code.FAILED_PRECONDITION),
        (AdapterError("rank too high"), code.INVALID_ARGUMENT),
        (InvalidRequestError("top_p"), code.INVALID_ARGUMENT),
        (CapacityError("queue full"), code.RESOURCE_EXHAUSTED),
        (BeyondCapacityError("prompt past the whole K/V cache"), code.OUT_OF_RANGE),
        (ModelLoadError("no such file"), code.FAILED_PRECONDITION),
        (TypeError("add_request() got an unexpected keyword argument 'adapter'"), code.INTERNAL),
        (KeyError("x"), code.INTERNAL),
    ]
    for error, want in cases:
        got, message = status_for(error)
        assert got == want, (error, got)
        if want == code.INTERNAL:  # a bug's text may carry paths, shapes, prompt words: the log only
            assert str(error).strip("'") not in message and "internal error (id " in message
        else:
            assert str(error).strip("'") in message


def test_outputs_queued_behind_a_slow_consumer_go_out_as_one_message():
    """A consumer slower than the engine's steps gets everything that came meanwhile as one
    output, and the pod's one message for it carries exactly the tokens and text of one message
    per step."""
    import asyncio

    from bench.fake_engine import FakeFastEngine
    from model_service.engine.async_engine import AsyncEngine
    from model_service.engine.sampling_params import SamplingParams

    engine = AsyncEngine(FakeFastEngine(0.001))

    async def consume(rid: str, pause: float) -> list[list]:
        batches = []
        params = SamplingParams(max_tokens=12)
        async for batch in engine.generate_batches(rid, prompt_token_ids=[1, 2], params=params):
            batches.append(batch)
            await asyncio.sleep(pause)
        return batches

    try:
        slow = asyncio.run(consume("slow", 0.02))
        steady = [[out] for out in asyncio.run(_outputs(engine, "steady"))]
    finally:
        engine.shutdown()
    assert slow[-1][-1].finished
    messages = [wire.chunk(b) for b in slow]
    one_each = [wire.chunk(b) for b in steady]
    assert [t for m in messages for t in m.chunk.token_ids] == list(range(100, 112))
    assert [t for m in one_each for t in m.chunk.token_ids] == list(range(100, 112))
    assert "".join(m.chunk.text for m in messages) == "".join(m.chunk.text for m in one_each) == "x" * 12
    assert len(messages) < 12  # one step a token: several steps went out as one message


def test_a_reader_that_stops_reading_holds_its_output_once_not_once_a_step():
    """A client that stops reading (gRPC flow control then holds the pod's handler at its send)
    while the engine runs on: every step's output waited in a queue, each with the request's
    whole text so far: 1.7 GB behind one stalled 20,000-token stream. What waits now is merged
    as it comes: about the output itself, and taken later it is the same tokens and text."""
    import asyncio
    import tracemalloc

    from bench.fake_engine import FakeFastEngine
    from model_service.engine.async_engine import AsyncEngine
    from model_service.engine.sampling_params import SamplingParams

    fake = FakeFastEngine(0.0)
    engine = AsyncEngine(fake)

    async def stall() -> tuple[list, int]:
        params = SamplingParams(max_tokens=3000)
        stream = engine.generate_batches("stalled", prompt_token_ids=[1, 2], params=params)
        first = await anext(stream)
        tracemalloc.start()
        while fake.running:  # the engine runs the request to its end, nobody reading
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # its last outputs reach the loop
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return [first, *[b async for b in stream]], held

    try:
        batches, held = asyncio.run(stall())
    finally:
        engine.shutdown()
    messages = [wire.chunk(b) for b in batches]
    assert [t for m in messages for t in m.chunk.token_ids] == list(range(100, 3100))
    assert "".join(m.chunk.text for m in messages) == "x" * 3000
    assert len(batches) == 2 and batches[-1][-1].finished
    assert held < 500_000, f"{held} bytes held for a stalled reader of 3,000 tokens"


def test_a_stream_interval_sends_n_tokens_a_message_but_the_first_and_the_rest():
    """`spindle serve --stream-interval 4`: through the pod's real gRPC server, the first token
    goes out alone (time to first token stays), then at least 4 a message, the rest at the end;
    the tokens and text are those of one message per step."""
    import asyncio

    import grpc

    from bench.fake_engine import FakeFastEngine
    from model_service.pod import server as pod_server
    from model_service.pod.state import ModelPod
    from spindle.v1 import generation_pb2_grpc

    parser = pod_server.build_parser(argparse.ArgumentParser())
    assert parser.parse_args(["--model", "m", "--stream-interval", "4"]).stream_interval == 4
    assert parser.parse_args(["--model", "m"]).stream_interval == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--stream-interval", "0"])

    async def stream(interval: int) -> list[pb.GenerateResponse]:
        pod = ModelPod("fake", drain_timeout=1.0, stream_interval=interval)
        servers = await pod_server.start(pod, "127.0.0.1", 0, 0)
        try:
            await pod.load(lambda: FakeFastEngine(0.002))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.port}") as ch:
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=14)
                return [m async for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=30)]
        finally:
            await servers.stop(0)
            pod.close()

    paced, steady = asyncio.run(stream(4)), asyncio.run(stream(1))
    for msgs in (paced, steady):
        assert [t for m in msgs for t in m.chunk.token_ids] == list(range(100, 114))
        assert "".join(m.chunk.text for m in msgs) == "x" * 14
        assert msgs[-1].final.usage.completion_tokens == 14
    sizes = [len(m.chunk.token_ids) for m in paced[:-1]]
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1])
    assert len(paced) <= 2 + -(-13 // 4)  # the first, 13 more four at a time, the final


def test_an_abort_that_comes_before_the_engine_has_the_request_still_stops_it():
    """The pod's Generate sends its headers (x-request-id) before it hands the request to the
    engine: an Abort in that gap was queued ahead of the request, found nothing to stop, and the
    request ran to max_tokens though Abort said OK (2 of 150 Aborts sent on seeing x-request-id
    through a loaded gateway)."""
    import asyncio

    from opentelemetry import trace

    from bench.fake_engine import FakeFastEngine
    from model_service.pod import server as pod_server
    from model_service.pod.generation import GenerationService
    from model_service.pod.state import ModelPod
    from spindle.openai_api.context import HttpCallContext

    class AbortedOnHeaders(HttpCallContext):
        """A caller that aborts the request the moment the headers name it."""

        async def send_initial_metadata(self, metadata) -> None:
            await super().send_initial_metadata(metadata)
            await service.Abort(pb.AbortRequest(request_id=self.request_id()), HttpCallContext({}))

    async def generate() -> pb.GenerateResponse:
        servers = await pod_server.start(pod, "127.0.0.1", 0, 0)
        try:
            await pod.load(lambda: FakeFastEngine(0.002))
            req = pb.GenerateRequest(request_id="r", token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=200)
            return [m async for m in service.Generate(req, AbortedOnHeaders({}))][-1]
        finally:
            await servers.stop(0)
            pod.close()

    pod = ModelPod("fake", drain_timeout=1.0)
    service = GenerationService(pod, trace.get_tracer(__name__))
    assert asyncio.run(generate()).final.finish_reason == pb.FINISH_REASON_ABORT


def test_tokens_held_for_the_stream_interval_go_out_before_a_lost_engine_ends_the_stream():
    """Outputs held back for `stream_interval` are yielded before the stream's error (the gateway
    resumes from what it relayed), and the first token was not held at all."""
    import asyncio

    from bench.fake_engine import FakeFastEngine
    from model_service.engine.async_engine import AsyncEngine
    from model_service.engine.sampling_params import SamplingParams
    from model_service.errors import UnavailableError

    engine = AsyncEngine(FakeFastEngine(0.002))

    async def consume() -> tuple[list[list[int]], BaseException | None]:
        batches: list[list[int]] = []
        params = SamplingParams(max_tokens=500)
        stream = engine.generate_batches("held", stream_interval=400, prompt_token_ids=[1, 2], params=params)
        try:
            async for batch in stream:
                batches.append([t for out in batch for t in out.new_token_ids])
                if len(batches) == 1:  # the engine is lost while the next batch is held back
                    asyncio.get_running_loop().call_later(0.05, engine.fail_streams, UnavailableError("lost"))
        except UnavailableError as e:
            return batches, e
        return batches, None

    try:
        batches, error = asyncio.run(consume())
    finally:
        engine.shutdown()
    assert isinstance(error, UnavailableError)
    assert len(batches) == 2 and batches[0] == [100] and len(batches[1]) > 1
    assert batches[1] == list(range(101, 101 + len(batches[1])))


async def _outputs(engine, rid: str) -> list:
    from model_service.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=12)
    return [out async for out in engine.generate(rid, prompt_token_ids=[1, 2], params=params)]


def test_a_message_for_several_outputs_keeps_each_tokens_logprobs():
    from model_service.engine.sampler import TokenLogprobs
    from model_service.engine.sequence import RequestOutput

    def out(tokens: list[int], text: str) -> RequestOutput:
        lps = [TokenLogprobs(-0.5 * t, [(t, -0.5 * t), (t + 1, -9.0)]) for t in tokens]
        return RequestOutput("r", tokens, text, [], "", False, None, 3, new_logprobs=lps)

    msg = wire.chunk([out([5], "a"), out([], ""), out([6, 7], "bc")])
    assert list(msg.chunk.token_ids) == [5, 6, 7] and msg.chunk.text == "abc" and msg.request_id == "r"
    assert [(lp.token_id, lp.logprob) for lp in msg.chunk.logprobs] == [(5, -2.5), (6, -3.0), (7, -3.5)]
    assert [[t.token_id for t in lp.top] for lp in msg.chunk.logprobs] == [[5, 6], [6, 7], [7, 8]]
    assert wire.chunk([out([], ""), out([], "")]) is None


def test_outputs_merged_for_a_late_reader_read_as_the_outputs_one_by_one():
    """What a reader takes late (`OutputStream`) is one output that says what the outputs that
    came meanwhile said: their tokens, text, logprobs and prompt logprobs joined, the first's
    scheduling time, the last's totals and end; an error after them still comes after them."""
    import asyncio

    from model_service.engine.output_stream import OutputStream
    from model_service.engine.sampler import TokenLogprobs
    from model_service.engine.sequence import RequestOutput
    from model_service.errors import UnavailableError

    def lps(tokens: list[int]) -> list[TokenLogprobs]:
        return [TokenLogprobs(-0.5 * t, [(t, -0.5 * t), (t + 1, -9.0)]) for t in tokens]

    ids = [9, 8, 5, 6, 7]
    prompt = ([9, 8], lps([8]))
    outs = [
        RequestOutput("r", [5], "a", (ids, 2, 3), "a", False, None, 2, lps([5]), None, None, 1.5, prompt),
        RequestOutput("r", [], "", (ids, 2, 3), "a", False, None, 2, first_scheduled_at=1.5),
        RequestOutput("r", [6, 7], "bc", (ids, 2, 5), "abc", True, "stop", 2, lps([6, 7]), 7, None, 1.5),
    ]

    async def late(then: Exception | None) -> list:
        stream = OutputStream()
        for out in [*outs, *([then] if then else [])]:
            stream.put(out)
        return await stream.take()

    merged, *rest = asyncio.run(late(None))
    assert rest == [] and wire.chunk([merged]) == wire.chunk(outs)
    assert (merged.token_ids, merged.text, merged.first_scheduled_at) == ([5, 6, 7], "abc", 1.5)
    assert (merged.finished, merged.finish_reason, merged.stop_reason) == (True, "stop", 7)
    assert wire.final(merged) == wire.final(outs[-1])
    outs[-1] = RequestOutput("r", [6], "b", (ids, 2, 4), "ab", False, None, 2, lps([6]))
    lost = UnavailableError("lost")
    merged, error = asyncio.run(late(lost))
    assert error is lost and wire.chunk([merged]) == wire.chunk(outs) and not merged.finished


def test_load_reports_answer_from_the_last_step_while_one_runs_long_and_fail_once_it_is_stuck():
    """A pod inside a long step (a long prompt's chunk on a CPU) still answers its load report
    in time, with the last step boundary's stats, from one engine call in flight; a step past the
    stall bound fails the report UNAVAILABLE, so the gateway ejects a stuck pod, not a busy one."""
    import asyncio
    import time

    from model_service.errors import UnavailableError
    from model_service.pod.load_stats import FRESH_WAIT_S, LoadStats

    async def scenario() -> None:
        calls, step = [], asyncio.Event()

        async def gather() -> int:  # the engine thread answers at its next step boundary
            calls.append(len(calls))
            await step.wait()
            return len(calls)

        stats = LoadStats(gather, stall_s=0.6)
        step.set()
        assert await stats.recent() == 1  # the first report waits for its own stats
        step.clear()  # a long step begins
        started = time.monotonic()
        assert [await stats.recent(), await stats.recent()] == [1, 1]
        assert time.monotonic() - started < 4 * FRESH_WAIT_S and len(calls) == 2  # one call in flight
        await asyncio.sleep(0.6)
        with pytest.raises(UnavailableError, match="has not finished a step in"):
            await stats.recent()
        step.set()  # the step ends: the pending call answers, and the next report is fresh
        await asyncio.sleep(0)
        assert await stats.recent() >= 2

    asyncio.run(scenario())


def test_a_pod_inside_a_long_step_answers_its_load_report_within_the_gateways_deadline():
    """Through the pod's real gRPC server: steps of 1.5 s (a long prompt's chunk on a CPU) and a
    request running; GetLoad at the gateway's 1 s deadline answers every time (it timed out, and
    two misses ejected the pod) and counts the request in flight."""
    import asyncio

    import grpc

    from bench.fake_engine import FakeFastEngine
    from model_service.pod import server as pod_server
    from model_service.pod.state import ModelPod
    from spindle.v1 import generation_pb2_grpc, pod_status_pb2, pod_status_pb2_grpc

    parser = pod_server.build_parser(argparse.ArgumentParser())
    assert parser.parse_args(["--model", "m"]).engine_stall_timeout == 120.0

    async def loads_during_a_long_step() -> list[pod_status_pb2.PodLoad]:
        pod = ModelPod("fake", drain_timeout=1.0)
        servers = await pod_server.start(pod, "127.0.0.1", 0, 0)
        try:
            await pod.load(lambda: FakeFastEngine(1.5))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.port}") as ch:
                status = pod_status_pb2_grpc.PodStatusStub(ch)
                await status.GetLoad(pod_status_pb2.GetLoadRequest(), timeout=5)  # idle: fresh stats
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=3)
                call = generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=30)
                await asyncio.sleep(0.3)  # the request is in its first step
                loads = [await status.GetLoad(pod_status_pb2.GetLoadRequest(), timeout=1.0) for _ in range(3)]
                call.cancel()
                return loads
        finally:
            await servers.stop(0)
            pod.close()

    loads = asyncio.run(loads_during_a_long_step())
    assert [load.requests_in_flight for load in loads] == [1, 1, 1]


def test_a_pod_whose_engine_is_stuck_past_the_stall_timeout_ends_its_streams_and_exits():
    """A step longer than `--engine-stall-timeout` (here a 3 s step against 0.4 s) is a stuck
    engine: the pod reports NOT_SERVING, its stream ends UNAVAILABLE (the gateway resumes it
    elsewhere) and it asks to exit 1, so Kubernetes restarts it; the health probes kept saying
    SERVING before."""
    import asyncio

    import grpc

    from bench.fake_engine import FakeFastEngine
    from model_service.pod import server as pod_server
    from model_service.pod.state import ModelPod
    from spindle.v1 import generation_pb2_grpc

    async def stuck() -> tuple[grpc.StatusCode, str, ModelPod]:
        pod = ModelPod("fake", drain_timeout=1.0, stall_timeout=0.4)
        servers = await pod_server.start(pod, "127.0.0.1", 0, 0)
        try:
            await pod.load(lambda: FakeFastEngine(3.0))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.port}") as ch:
                req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), max_tokens=3)
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    async for _ in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=30):
                        pass
            await asyncio.wait_for(pod.exit_requested.wait(), 5)
            return failed.value.code(), failed.value.details(), pod
        finally:
            await servers.stop(0)
            pod.close()

    code, details, pod = asyncio.run(stuck())
    assert code == grpc.StatusCode.UNAVAILABLE and "has not finished a step in" in details
    assert pod.exit_code == 1 and pod.health is not None and not pod.health.serving


@pytest.mark.parametrize(
    "code, pods_tried",
    [(grpc.StatusCode.RESOURCE_EXHAUSTED, 2), (grpc.StatusCode.OUT_OF_RANGE, 1)],
)
def test_a_pod_at_capacity_is_failed_over_and_one_that_can_never_fit_is_not(code, pods_tried):
    """A pod's RESOURCE_EXHAUSTED (its queue full: transient) sends the request to the next pod,
    and when every pod is full the caller gets it with a retry hint; OUT_OF_RANGE (larger than the
    pod can ever hold: permanent) ends the request there with the pod's message, other pods not
    tried (it was RESOURCE_EXHAUSTED too, tried on every pod, then retried by the client)."""
    import asyncio

    from gateway.pods import Pod, PodPool, static_discovery
    from gateway.server import GatewayService
    from spindle.openai_api.context import HttpCallContext, Refused

    tried = []

    def refusing(address: str):
        def call(*args, **kwargs):
            tried.append(address)
            raise grpc.aio.AioRpcError(
                code, grpc.aio.Metadata(), grpc.aio.Metadata(), "needs 82 blocks; has 64"
            )

        return call

    async def go() -> Refused:
        pool = PodPool(static_discovery([]))
        for address in ("a:1", "b:1"):
            pod = pool.pods[address] = Pod(address, [])
            pod.healthy, pod.generate_raw = True, refusing(address)
        with pytest.raises(Refused) as e:
            async for _ in GatewayService(pool, None).Generate(
                pb.GenerateRequest(text="hi"), HttpCallContext({})
            ):
                pass
        await pool.close()
        return e.value

    refused = asyncio.run(go())
    assert refused.code == code and len(tried) == pods_tried and "needs 82 blocks; has 64" in refused.details
    assert any(k == "retry-after-ms" for k, _ in refused.trailers) == (
        code == grpc.StatusCode.RESOURCE_EXHAUSTED
    )


@pytest.mark.parametrize("streamed", [False, True])
def test_an_unexpected_exception_reaches_the_caller_as_an_id_and_the_log_has_it(
    streamed, monkeypatch, caplog
):
    """A bug in a handler (the gateway's here, on a server every Spindle service makes with
    `serving.make_server`) ended UNKNOWN "Unexpected <class 'ValueError'>: <its text>", which
    may carry file paths, tensor shapes or a prompt's words. Now INTERNAL with an error id; the
    log line has the id and the traceback. A deliberate refusal keeps its message."""
    import asyncio

    from gateway.pods import PodPool, static_discovery
    from gateway.server import GatewayService
    from spindle import serving
    from spindle.v1 import generation_pb2_grpc

    secret = "shape (4, 7) at /srv/model/secret.py for prompt 'my password'"

    def broken(*args, **kwargs):
        raise ValueError(secret)

    async def go() -> list[grpc.aio.AioRpcError]:
        pool = PodPool(static_discovery([]))
        gateway = GatewayService(pool, None)
        monkeypatch.setattr(gateway, "_choose", broken)
        server = serving.make_server()
        generation_pb2_grpc.add_GenerationServicer_to_server(gateway, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        errors = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                if streamed:
                    async for _ in stub.Generate(pb.GenerateRequest(text="hi"), timeout=10):
                        pass
                else:
                    await stub.ListModels(pb.ListModelsRequest(), timeout=10)
            errors.append(e.value)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(pb.GenerateRequest(), timeout=10):  # no prompt
                    pass
            errors.append(e.value)
        await server.stop(None)
        await pool.close()
        return errors

    if not streamed:
        monkeypatch.setattr(PodPool, "healthy", broken)  # ListModels reads it first
    bug, refusal = asyncio.run(go())
    assert bug.code() == grpc.StatusCode.INTERNAL, bug
    assert "secret" not in bug.details() and "ValueError" not in bug.details()
    error_id = re.fullmatch(
        r"internal error \(id ([0-9a-f]{16})\); the server's log has the details", bug.details()
    )
    assert error_id, bug.details()
    logged = [r for r in caplog.records if error_id.group(1) in r.getMessage()]
    assert logged and secret in str(logged[0].exc_info[1])  # the id, with the traceback
    assert refusal.code() == grpc.StatusCode.INVALID_ARGUMENT and "has no prompt" in refusal.details()


_STUCK_SHUTDOWN = """
import asyncio, time
from spindle import serving

async def wait_on_a_peer_that_never_answers():
    await asyncio.Event().wait()

async def main(stuck):
    serving.exit_if_stuck(STUCK_S if stuck else 30.0, "the test service")
    if stuck:
        await wait_on_a_peer_that_never_answers()

asyncio.run(main(STUCK))
"""


@pytest.mark.parametrize("stuck", [True, False])
def test_a_shutdown_stuck_on_an_await_exits_with_its_stacks_and_one_in_time_is_not_delayed(stuck):
    """The bound a service puts on its own exit at SIGTERM: a stuck one ends, status 1, naming the
    coroutine it waited in; one that ends in time is not held up by the timer."""
    code = _STUCK_SHUTDOWN.replace("STUCK_S", "0.5").replace("STUCK)", f"{stuck})")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert time.monotonic() - started < 15
    if stuck:
        assert done.returncode == 1, done.stderr
        assert "the test service still running 0.5 s after it began to stop" in done.stderr
        assert "wait_on_a_peer_that_never_answers" in done.stderr
    else:
        assert done.returncode == 0 and not done.stderr, done.stderr


_STOP_WHILE_BUILDING = """
import asyncio, threading, time
from spindle import serving

async def main():
    build = asyncio.create_task(serving.in_daemon_thread(lambda: time.sleep(30), "engine-build"))
    await asyncio.sleep(0.2)  # SIGTERM arrives while the engine is being built
    build.cancel()

asyncio.run(main())
"""


def test_a_process_told_to_stop_while_it_builds_its_engine_does_not_wait_for_the_build():
    """A model pod SIGTERMed while it loaded exited only once the load ended: `asyncio.to_thread`'s
    threads are joined when the loop ends. The build's daemon thread is left behind instead; what
    it returns or raises still reaches the awaiting task."""
    from spindle import serving

    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _STOP_WHILE_BUILDING], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)  # fmt: skip
    assert done.returncode == 0 and not done.stderr, done.stderr
    assert time.monotonic() - started < 15  # the build alone takes 30 s

    def broken() -> None:
        raise ValueError("no such model")

    async def both() -> tuple[int, BaseException | None]:
        value = await serving.in_daemon_thread(lambda: 7, "t")
        try:
            await serving.in_daemon_thread(broken, "t")
        except ValueError as e:
            return value, e
        return value, None

    value, error = asyncio.run(both())
    assert value == 7 and isinstance(error, ValueError) and "no such model" in str(error)
