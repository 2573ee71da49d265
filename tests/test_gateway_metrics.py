"""The gateway's Prometheus /metrics, scraped over HTTP from a real gateway in this event loop in
front of fake pods (bench/fake_engine.py): requests admitted, refused by its own rules, failed
over mid-stream, and over the OpenAI-compatible HTTP API; the exposition parses and counts each
once, and no label carries what a caller chose (request ids, key names, adapters, paths)."""

from __future__ import annotations

import asyncio
import urllib.request

import aiohttp
import grpc
from prometheus_client.parser import text_string_to_metric_families

from spindle.v1 import generation_pb2 as pb
from tests.service_helpers import free_port
from tests.test_gateway_fleet import _first, _tokens, _until, fake_pod, gateway_to

Code = grpc.StatusCode
KEYS = "ok  key-ok  *\nrated  key-rated  *  rate=0.01  burst=1\nsql  key-sql  sql\n"


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the gateway's /metrics by (name, sorted labels); the text must parse."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def _code(stub, req: pb.GenerateRequest, key: str) -> Code:
    try:
        await _tokens(stub, req, metadata=(("authorization", f"Bearer {key}"),))
    except grpc.aio.AioRpcError as e:
        return e.code()
    return Code.OK


async def _code_of(call) -> Code:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return Code.OK


def test_the_gateway_counts_requests_refusals_failovers_and_http_calls(tmp_path):
    (tmp_path / "keys").write_text(KEYS)
    metrics_port, http_port = free_port(), free_port()
    flags = ("--api-keys-file", str(tmp_path / "keys"), "--metrics-port", str(metrics_port))
    flags += ("--http-port", str(http_port))

    async def go() -> None:
        one, two = fake_pod("alpha", 100, step_s=0.01), fake_pod("alpha", 100, step_s=0.01)
        async with one as (a, _), two as (b, _), gateway_to(a, b, flags=flags) as (gw, stub):
            await _until(lambda: len(gw.pool.healthy()) == 2)
            short = pb.GenerateRequest(text="hi", max_tokens=3)
            assert await _code(stub, short, "key-ok") == Code.OK
            assert await _code(stub, short, "key-rated") == Code.OK
            assert await _code(stub, short, "key-rated") == Code.RESOURCE_EXHAUSTED
            assert await _code(stub, pb.GenerateRequest(text="hi", adapter="x"), "key-sql") == (
                Code.PERMISSION_DENIED
            )
            assert await _code(stub, pb.GenerateRequest(text="hi", priority=-1), "key-ok") == (
                Code.PERMISSION_DENIED
            )
            assert await _code(stub, pb.GenerateRequest(text="hi", model="nope"), "key-ok") == Code.NOT_FOUND
            await stub.ListModels(pb.ListModelsRequest(), metadata=(("authorization", "Bearer key-ok"),))

            # A stream whose pod dies mid-stream goes on on the other pod: one resume, one ejection.
            long = pb.GenerateRequest(text="go on", max_tokens=60, request_id="failover-1")
            call = stub.Generate(long, metadata=(("authorization", "Bearer key-ok"),), timeout=10)
            [m async for m in _first(call, 3)]
            assert _value(_scrape(metrics_port), "spindle_gateway_streams_in_flight") == 1
            first_pod = gw.inflight["failover-1"].pod.address
            await (a if first_pod.endswith(f":{a.port}") else b).stop(0)
            rest = []
            while (m := await call.read()) is not grpc.aio.EOF:
                rest.append(m)
            assert rest[-1].HasField("final")

            # A caller that leaves mid-stream, and one whose deadline passes mid-stream: grpc.aio
            # ends both by cancelling the handler, but the caller of the second sees DEADLINE_EXCEEDED.
            auth = (("authorization", "Bearer key-ok"),)
            left = stub.Generate(pb.GenerateRequest(text="bye", max_tokens=1000), metadata=auth, timeout=10)
            [m async for m in _first(left, 2)]
            left.cancel()
            late = stub.Generate(pb.GenerateRequest(text="late", max_tokens=1000), metadata=auth, timeout=0.3)
            assert await _code_of(late) == Code.DEADLINE_EXCEEDED

            async with aiohttp.ClientSession(headers={"authorization": "Bearer key-ok"}) as http:
                for path in ("/v1/models", "/v1/models/alpha", "/no/such/path"):
                    async with http.get(f"http://127.0.0.1:{gw.http_port}{path}") as r:
                        await r.read()
            samples = _scrape(metrics_port)

        def requests(method: str, model: str, code: str) -> float:
            return _value(samples, "spindle_gateway_requests_total", method=method, model=model, code=code)

        assert requests("Generate", "alpha", "OK") == 3  # two short, the failed-over one
        assert requests("Generate", "alpha", "RESOURCE_EXHAUSTED") == 1
        assert requests("Generate", "alpha", "PERMISSION_DENIED") == 2
        assert requests("Generate", "other", "NOT_FOUND") == 1  # the name a caller made up is no label
        assert requests("Generate", "alpha", "CANCELLED") == 1
        assert requests("Generate", "alpha", "DEADLINE_EXCEEDED") == 1  # was counted CANCELLED
        assert requests("ListModels", "", "OK") == 3  # one over gRPC, two under the HTTP model routes
        refusals = {r: _value(samples, "spindle_gateway_refusals_total", reason=r) for r in
                    ("rate_limit", "adapter", "priority", "streams", "draining")}  # fmt: skip
        assert refusals == {"rate_limit": 1, "adapter": 1, "priority": 1, "streams": 0, "draining": 0}
        assert _value(samples, "spindle_gateway_resumes_total") == 1
        assert _value(samples, "spindle_gateway_retries_total") == 0
        ejections = {
            ls[0][1]: v for (name, ls), v in samples.items() if name == "spindle_gateway_pod_ejections_total"
        }
        assert sum(ejections.values()) == 1 and set(ejections) <= {"unavailable", "health_check"}, ejections
        assert _value(samples, "spindle_gateway_pod_healthy", pod=first_pod) == 0
        assert _value(samples, "spindle_gateway_streams_in_flight") == 0
        assert _value(samples, "spindle_gateway_time_to_first_token_seconds_count", model="alpha") == 5
        assert _value(samples, "spindle_gateway_request_duration_seconds_count", model="alpha") == 3
        http = {(k[1][0][1], k[1][1][1], k[1][2][1]): v for k, v in samples.items()
                if k[0] == "spindle_gateway_http_requests_total"}  # fmt: skip
        assert http == {
            ("GET", "/v1/models", "200"): 1,
            ("GET", "/v1/models/{model}", "200"): 1,
            ("GET", "unmatched", "404"): 1,
        }
        labels = {v for name, ls in samples for _, v in ls}
        assert not labels & {"failover-1", "ok", "rated", "sql", "x", "nope", "/no/such/path"}

    asyncio.run(go())
