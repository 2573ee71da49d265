"""A heterogeneous fleet behind one gateway, in one event loop: fake pods (bench/fake_engine.py)
serving different base models, pods that fail every request or run ten times slower, pods
coming and going. Each engine's tokens name its model (`first` + position), so a stream that
went on under another model shows in its ids."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from bench.fake_engine import FakeFastEngine
from gateway import auth
from gateway.pods import _restarted
from model_service.engine.requests import PromptReader
from model_service.engine.sequence import RequestOutput
from model_service.errors import ContextLengthError
from model_service.pod import server as pod_server
from model_service.pod.state import ModelPod
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc, pod_status_pb2
from tests.service_helpers import gateway_in_process

Code = grpc.StatusCode


class ModelEngine(FakeFastEngine):
    """The fake engine whose n-th output token is `first + n` (one model's tokens apart from
    another's), serving `adapters`."""

    def __init__(self, step_s: float, first: int, adapters: tuple[str, ...] = ()) -> None:
        super().__init__(step_s, adapters)
        self.first = first

    def step(self) -> list:
        outputs = super().step()
        for out in outputs:
            out.new_token_ids = [t - 100 + self.first for t in out.new_token_ids]
        return outputs


@contextlib.asynccontextmanager
async def fake_pod(
    name: str,
    first: int,
    step_s: float = 0.001,
    load: bool = True,
    engine: Callable = ModelEngine,
    port: int = 0,
) -> AsyncIterator:
    """A pod serving base model `name` in this event loop: (its servers, the ModelPod)."""
    pod = ModelPod(name, drain_timeout=1.0)
    servers = await pod_server.start(pod, "127.0.0.1", port, 0)
    try:
        if load:
            await pod.load(lambda: engine(step_s, first))
        yield servers, pod
    finally:
        await servers.stop(0)
        pod.close()


@contextlib.asynccontextmanager
async def gateway_to(*pods: Any, flags: tuple[str, ...] = ()) -> AsyncIterator[tuple[Any, Any]]:
    """A gateway in this event loop in front of `pods` (their servers): (it, a Generation stub)."""
    addresses = ",".join(f"127.0.0.1:{p.port}" for p in pods)
    flags = ("--pods", addresses, "--allow-unauthenticated", *flags)
    async with gateway_in_process(list(flags)) as gw, grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
        yield gw, generation_pb2_grpc.GenerationStub(ch)


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _tokens(stub, req: pb.GenerateRequest, timeout: float = 5.0, metadata: tuple = ()) -> list[int]:
    stream = stub.Generate(req, timeout=timeout, metadata=metadata)
    return [t async for m in stream if m.HasField("chunk") for t in m.chunk.token_ids]


async def _code(stub, req: pb.GenerateRequest) -> tuple[Code, str]:
    try:
        await _tokens(stub, req)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    raise AssertionError("the request succeeded")


def _with_sql(step_s: float, first: int) -> ModelEngine:
    return ModelEngine(step_s, first, adapters=("sql",))


def test_two_base_models_each_request_goes_to_a_pod_of_its_model():
    """A request naming a model went to any pod: half failed NOT_FOUND on the other model's pod;
    an unknown model was refused naming one pod's model; an unnamed one ran on either model."""

    async def go() -> None:
        alpha, beta = fake_pod("alpha", 100), fake_pod("beta", 500, engine=_with_sql)
        async with alpha as (a, _), beta as (b, _), gateway_to(a, b) as (gw, stub):
            await _until(lambda: len(gw.pool.healthy()) == 2)
            for model, first in [("beta", 500), ("alpha", 100)] * 6:
                req = pb.GenerateRequest(text="hi", model=model, max_tokens=3)
                assert await _tokens(stub, req) == [first, first + 1, first + 2]
            code, details = await _code(stub, pb.GenerateRequest(text="hi", model="gamma", max_tokens=3))
            assert code == Code.NOT_FOUND and "served: alpha, beta" in details
            code, details = await _code(stub, pb.GenerateRequest(text="hi", model="sql", max_tokens=3))
            assert code == Code.NOT_FOUND and "'sql' is a LoRA adapter" in details and "`adapter`" in details
            code, details = await _code(
                stub, pb.GenerateRequest(text="hi", adapter="gamma")
            )  # HTTP's unknown `model`
            assert code == Code.NOT_FOUND and "adapter 'gamma' (base models: alpha, beta)" in details
            code, details = await _code(stub, pb.GenerateRequest(text="hi", max_tokens=3))
            assert code == Code.INVALID_ARGUMENT and "alpha, beta" in details
            for _ in range(4):  # an adapter named alone (vLLM's `model`) says its base: the pods holding it
                assert await _tokens(stub, pb.GenerateRequest(text="hi", adapter="sql", max_tokens=2)) == [
                    500,
                    501,
                ]
            listed = await stub.ListModels(pb.ListModelsRequest(), timeout=5)
            assert {m.id: m.base_model for m in listed.models} == {"alpha": "", "beta": "", "sql": "beta"}

    asyncio.run(go())


def test_a_stream_resumes_only_on_a_pod_of_the_model_it_began_on():
    """An unnamed request began on the only model's pod; a pod of a new model came (a rollout),
    the first pod died mid-stream: the stream went on on the new model's pod, its tokens glued
    to the old model's (a silent wrong answer). It now fails UNAVAILABLE: no pod of its model."""

    async def go() -> None:
        alpha, beta = fake_pod("alpha", 100, step_s=0.01), fake_pod("beta", 500, load=False)
        async with alpha as (a, _), beta as (b, late), gateway_to(a, b) as (gw, stub):
            call = stub.Generate(pb.GenerateRequest(text="hi", max_tokens=200), timeout=10)
            got = [t async for m in _first(call, 3) for t in m.chunk.token_ids]
            await late.load(lambda: ModelEngine(0.001, 500))
            await _until(lambda: len(gw.pool.healthy()) == 2)
            await a.stop(0)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                while (m := await call.read()) is not grpc.aio.EOF:
                    got += m.chunk.token_ids
            assert failed.value.code() == Code.UNAVAILABLE and all(100 <= t < 500 for t in got), got

    asyncio.run(go())


async def _first(call, n: int) -> AsyncIterator[pb.GenerateResponse]:
    """The first `n` messages of a stream, leaving the rest to read."""
    for _ in range(n):
        yield await call.read()


class BrokenEngine(FakeFastEngine):
    """A pod alive and SERVING whose every request fails in the engine (INTERNAL)."""

    def __init__(self, step_s: float, first: int) -> None:
        super().__init__(step_s)

    def step(self) -> list:
        time.sleep(self.step_s)
        failed = [
            RequestOutput(rid, [], "", [], "", True, "error", 1, error="broken") for rid in self.running
        ]
        self.running.clear()
        return failed


def test_a_pod_failing_every_request_is_ejected_as_an_outlier():
    """A pod whose checks pass but whose every request failed INTERNAL stayed in rotation: a
    quarter of all requests failed for good (it looked idle, so it drew its share and more).
    Now five failures in a row eject it for --outlier-ejection s, checks passing or not; the
    last pod of a model is never ejected so."""

    async def go() -> None:
        good, bad = fake_pod("alpha", 100, step_s=0.005), fake_pod("alpha", 100, engine=BrokenEngine)
        async with good as (a, _), bad as (b, _), gateway_to(a, b) as (gw, stub):
            await _until(lambda: len(gw.pool.healthy()) == 2)
            failed = 0
            for wave in range(12):
                reqs = [pb.GenerateRequest(text=f"hi {wave} {i}", max_tokens=5) for i in range(4)]
                outcomes = await asyncio.gather(*(_tokens(stub, r) for r in reqs), return_exceptions=True)
                failed += sum(isinstance(o, grpc.aio.AioRpcError) for o in outcomes)
            assert 5 <= failed <= 8, failed  # the five that ejected it, and a wave's others in flight
            assert [p.address for p in gw.pool.healthy()] == [f"127.0.0.1:{a.port}"]
            ejected = gw.metrics.registry.get_sample_value(
                "spindle_gateway_pod_ejections_total", {"reason": "outlier"}
            )
            assert ejected == 1
        async with fake_pod("alpha", 100, engine=BrokenEngine) as (b, _), gateway_to(b) as (gw, stub):
            for _ in range(8):  # alone, it stays: every pod failing says more of the requests
                assert (await _code(stub, pb.GenerateRequest(text="hi", max_tokens=5)))[0] == Code.INTERNAL
            assert len(gw.pool.healthy()) == 1

    asyncio.run(go())


def test_a_pod_ten_times_slower_draws_a_small_share_under_load():
    """Eight callers, each sending one request after another, in front of a pod and one ten times
    slower: scored by waiting requests only (none on either: the batches had room), the slow pod
    drew 40-50% of the requests and held their callers ten times as long. Scored by requests in
    flight it draws less the slower it is (least outstanding requests: 1/11 when the counts
    even out; here ~20%, the fast pod's gRPC overhead on two shared cores)."""

    async def go() -> tuple[int, int]:
        fast, slow = fake_pod("alpha", 100, step_s=0.002), fake_pod("alpha", 100, step_s=0.02)
        async with fast as (a, fast_pod), slow as (b, slow_pod), gateway_to(a, b) as (gw, stub):
            await _until(lambda: len(gw.pool.healthy()) == 2)

            async def caller(c: int) -> None:
                for i in range(12):
                    await _tokens(stub, pb.GenerateRequest(text=f"caller {c} turn {i}", max_tokens=20))

            await asyncio.gather(*(caller(c) for c in range(8)))
            return fast_pod.requests_total, slow_pod.requests_total

    fast, slow = asyncio.run(go())
    assert fast + slow == 96 and slow <= 96 * 0.3, (fast, slow)  # 14-22 of 96 now, 39-47 before


def test_a_pod_restarted_on_its_address_with_another_model_is_routed_by_its_new_one():
    """Between two polls a pod came back on its address serving another model: requests for the
    model it used to serve were refused NOT_FOUND there (the gateway's stale view, told to the
    caller as its error). Now the refusal has the pod checked again and the request goes on to a
    pod of its model; the restarted pod's prefixes are forgotten."""

    async def go() -> None:
        stay, leave = fake_pod("alpha", 100), fake_pod("alpha", 100)
        flags = ("--health-interval", "60")  # no poll sees the restart
        async with stay as (a, _), leave as (b, _), gateway_to(a, b, flags=flags) as (gw, stub):
            await _until(lambda: len(gw.pool.healthy()) == 2)
            address, hashes = f"127.0.0.1:{b.port}", [b"x" * 16]
            gw.prefixes.record(hashes, address)
            await b.stop(0)
            async with fake_pod("beta", 500, port=b.port):
                pod = gw.pool.pods[address]
                ready = grpc.ChannelConnectivity.READY
                await _until(
                    lambda: all(c.get_state(True) == ready for c in (pod.channel, pod.relay_channel))
                )
                for _ in range(30):  # until one is routed to the restarted pod (a coin flip each)
                    req = pb.GenerateRequest(text="hi", model="alpha", max_tokens=3)
                    assert await _tokens(stub, req) == [100, 101, 102]
                    if pod.serves("beta"):
                        break
                assert pod.serves("beta") and pod.healthy
                assert gw.prefixes.match(hashes, [address]) == {address: 0.0}

    asyncio.run(go())
    before = pod_status_pb2.PodLoad(model="alpha", requests_total=9)  # the same model, restarted
    assert _restarted(before, pod_status_pb2.PodLoad(model="alpha", requests_total=2))
    assert not _restarted(before, pod_status_pb2.PodLoad(model="alpha", requests_total=9))


def _short(context: int) -> type:
    """ModelEngine with a context of `context` tokens: a prompt's characters count as its tokens,
    refused past the context as the engine's PromptReader refuses them."""

    class Short(ModelEngine):
        max_model_len = context

        def add_request(self, prompt=None, *, prompt_token_ids=None, **kw) -> str:
            reader = PromptReader(None, self.vocab_size, self.max_model_len, 1 << 20, 1)
            reader.token_ids(None, None, prompt_token_ids or [1] * len(prompt or ""))
            return super().add_request(prompt, prompt_token_ids=prompt_token_ids, **kw)

    return Short


def test_a_prompt_too_long_for_one_pod_goes_to_a_pod_of_its_model_where_it_fits():
    """Pods of one model with different contexts (--max-model-len): a prompt longer than one
    pod's context was refused INVALID_ARGUMENT whenever it was routed there, though another pod
    could serve it. Now a token-id prompt goes only to pods it fits, a text prompt goes on after
    the refusal (the pod says the prompt's length), and one that fits none is still refused."""

    async def go() -> None:
        short, long = fake_pod("alpha", 100, engine=_short(32)), fake_pod("alpha", 100, engine=_short(128))
        async with short as (a, short_pod), long as (b, long_pod), gateway_to(a, b) as (gw, stub):
            await _until(lambda: len(gw.pool.healthy()) == 2)
            for i in range(6):
                text = pb.GenerateRequest(text=f"{i:02d}" + "x" * 60, max_tokens=2)
                ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[i] * 60), max_tokens=2)
                assert await _tokens(stub, text) == await _tokens(stub, ids) == [100, 101]
            assert long_pod.requests_total == 12
            retries = gw.metrics.registry.get_sample_value("spindle_gateway_retries_total")
            assert retries == short_pod.requests_total  # each it refused
            code, details = await _code(stub, pb.GenerateRequest(text="x" * 200, max_tokens=2))
            assert code == Code.INVALID_ARGUMENT and "context of this model's pods is 128" in details
            code, details = await _code(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 200)))
            assert code == Code.INVALID_ARGUMENT and "context of this model's pods is 128" in details
            listed = await stub.ListModels(pb.ListModelsRequest(), timeout=5)
            assert [m.max_model_len for m in listed.models] == [128]

    asyncio.run(go())
    with pytest.raises(ContextLengthError) as refused:  # the real engine's refusal says the length
        PromptReader(None, 1000, 32, 1 << 20, 1).token_ids(None, None, [5] * 40)
    assert refused.value.prompt_tokens == 40


def test_a_key_may_not_put_its_requests_ahead_of_other_keys(tmp_path):
    """Any API key could send `priority` -2**31: its requests were served first and preempted
    every other key's. A key now asks for at most the urgency its line grants (`priority=P`,
    absent 0): lower is PERMISSION_DENIED naming it; putting its own requests back is free."""
    keys = tmp_path / "keys"
    keys.write_text("ops  key-ops  *  priority=-10\nuser  key-user  *\n")
    assert {c.name: c.priority for c in auth.parse_keys(keys.read_text(), "keys").values()} == {
        "ops": -10,
        "user": 0,
    }

    async def go() -> None:
        flags = ("--api-keys-file", str(keys))
        async with fake_pod("alpha", 100) as (a, _), gateway_to(a, flags=flags) as (_, stub):

            async def ask(key: str, priority: int) -> Code:
                req = pb.GenerateRequest(text="hi", max_tokens=2, priority=priority)
                try:
                    await _tokens(stub, req, metadata=(("authorization", f"Bearer {key}"),))
                except grpc.aio.AioRpcError as e:
                    assert "priority" in e.details(), e
                    return e.code()
                return Code.OK

            assert await ask("key-user", -1) == Code.PERMISSION_DENIED
            assert await ask("key-user", 5) == await ask("key-ops", -10) == Code.OK
            assert await ask("key-ops", -11) == Code.PERMISSION_DENIED

    asyncio.run(go())


class StepRaisingEngine(ModelEngine):
    """A pod whose engine steps raise once it has a request past its warm-up (a fault outside
    the engine's per-request guards)."""

    def step(self) -> list:
        if any(not rid.startswith("warmup-") for rid in self.running):
            raise RuntimeError("the step is broken")
        return super().step()


def test_a_pod_whose_engine_steps_keep_raising_is_lost_and_its_streams_go_on_elsewhere():
    """The engine thread logged a raising step and stepped again, forever: the pod's streams got
    no output until their deadlines while its health said SERVING. Three in a row now end them
    UNAVAILABLE (the gateway goes on on another pod) and the pod as a lost device does."""

    async def go() -> None:
        good, bad = fake_pod("alpha", 100), fake_pod("alpha", 100, engine=StepRaisingEngine)
        async with good as (a, _), bad as (b, broken), gateway_to(a, b) as (gw, stub):
            await _until(lambda: len(gw.pool.healthy()) == 2)
            for i in range(12):
                req = pb.GenerateRequest(text=f"hi {i}", max_tokens=3)
                assert await _tokens(stub, req, timeout=3) == [100, 101, 102]
                if broken.requests_total:
                    break
            assert broken.requests_total == 1 and broken.lost and "RuntimeError" in broken.lost
            assert [p.address for p in gw.pool.healthy()] == [f"127.0.0.1:{a.port}"]

    asyncio.run(go())


def test_list_models_answers_during_a_long_step():
    """ListModels asked the engine thread for the pod's adapters, which answers between steps: a
    step of 48 s (one long prefill on a CPU) held it that long, and the gateway's ListModels (HTTP
    /v1/models too) failed after 5 s. It reads them as of the last step boundary now."""

    async def go() -> None:
        async with (
            fake_pod("alpha", 100, step_s=1.0, engine=_with_sql) as (a, _),
            gateway_to(a) as (gw, stub),
        ):
            await _until(lambda: len(gw.pool.healthy()) == 1)
            busy = asyncio.create_task(_tokens(stub, pb.GenerateRequest(text="hi", max_tokens=2)))
            await asyncio.sleep(0.2)  # its first step runs
            async with grpc.aio.insecure_channel(f"127.0.0.1:{a.port}") as channel:
                for listing in (stub, generation_pb2_grpc.GenerationStub(channel)):
                    listed = await listing.ListModels(pb.ListModelsRequest(), timeout=0.5)
                    assert [m.id for m in listed.models] == ["alpha", "sql"]
            assert await busy == [100, 101]

    asyncio.run(go())
