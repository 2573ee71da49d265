"""API keys at the gateway: the key file's limits, constant-time lookup, and RESOURCE_EXHAUSTED with
a retry hint from a real gateway (in this test's event loop, in front of an in-process tiny pod)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2, status_pb2
from multidict import CIMultiDict, CIMultiDictProxy

from gateway import auth
from gateway.limits import Limits
from spindle.openai_api.context import HttpCallContext
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import generation_pb2_grpc
from tests.service_helpers import free_port, gateway_in_process, pod_in_process, token_request

Code = grpc.StatusCode


def test_key_lines_old_and_new_and_their_errors():
    keys = auth.parse_keys(
        "old  k1  *\nadm  k2  a,b  admin\nlim  k3==  -  rate=2.5  burst=4  concurrency=1\n"
        "both k4 * admin concurrency=3\n",
        "keys",
    )
    by_name = {c.name: c for c in keys.values()}
    assert by_name["old"] == auth.Caller("old", None)
    assert by_name["adm"].admin and by_name["adm"].adapters == {"a", "b"}
    assert (by_name["lim"].rate, by_name["lim"].burst, by_name["lim"].concurrency) == (2.5, 4, 1)
    assert auth._digest("k3==") in keys  # a key may end in `=` (base64)
    assert by_name["both"].admin and by_name["both"].concurrency == 3
    bad_lines = [("x k * rate=fast", "rate=fast"), ("x k * rate=-1", "finite"), ("x k * rate=inf", "finite"),
                 ("x k * admin extra", "expected"), ("x k * root", "unknown scope")]  # fmt: skip
    for bad, why in bad_lines:
        with pytest.raises(ValueError, match=why):
            auth.parse_keys(bad, "keys")


def test_a_key_given_to_two_callers_is_refused_in_a_file_and_across_a_directory(tmp_path):
    # The later line won: alice's key authenticated as mallory, with mallory's adapters and scopes.
    with pytest.raises(ValueError, match=r"keys:2: this key is also 'alice'"):
        auth.parse_keys("alice k1 a\nmallory k1 * admin\n", "keys")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "a").write_text("alice k1 a\n")
    (secret / "b").write_text("bob k2 -\n")
    keys = auth.ApiKeys(secret)
    (secret / "b").write_text("bob k2 -\nmallory k1 * admin\n")  # an edit: refused, the old keys kept
    assert not keys.reload()
    assert keys.authenticate((("x-api-key", "k1"),)).name == "alice"
    with pytest.raises(ValueError, match="a key of 'mallory' is also 'alice'"):
        auth.ApiKeys(secret)


def test_every_key_is_compared_in_constant_time(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("".join(f"user{i} key-{i} *\n" for i in range(5)))
    keys = auth.ApiKeys(path)
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    for offered in ("key-0", "key-4", "nope"):
        calls.clear()
        with contextlib.suppress(auth.AuthError):
            keys.authenticate((("authorization", f"Bearer {offered}"),))
        assert len(calls) == 5  # no early exit on a match


def test_a_call_offering_two_different_keys_is_refused_whichever_way_they_come(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice ka *\nbob kb -\n")
    keys = auth.ApiKeys(path)
    two = [
        (("authorization", "Bearer ka"), ("x-api-key", "kb")),
        (("x-api-key", "kb"), ("authorization", "bearer ka")),
        (("authorization", "Bearer ka"), ("authorization", "Bearer kb")),
    ]
    for metadata in two:  # the last key won: bob, whatever a proxy in front had checked
        with pytest.raises(auth.AuthError, match="2 different API keys"):
            keys.authenticate(metadata)
    # The HTTP front hands its headers in as metadata, a repeated one included.
    headers = CIMultiDictProxy(CIMultiDict([("Authorization", "Bearer ka"), ("X-Api-Key", "kb")]))
    with pytest.raises(auth.AuthError, match="2 different API keys"):
        keys.authenticate(HttpCallContext(headers).invocation_metadata())
    one = [
        (("authorization", "Bearer ka"), ("x-api-key", "ka")),  # the same key twice is one key
        (("authorization", "Bearer ka"), ("x-api-key", " ")),  # a blank header offers none (was: missing)
        (("authorization", "Bearer ka"), ("authorization", "Basic Zm9vOmJhcg==")),
    ]
    for metadata in one:
        assert keys.authenticate(metadata).name == "alice"


def test_token_bucket_and_stream_slots():
    now = [0.0]
    limits = Limits(clock=lambda: now[0])
    caller = auth.Caller("c", None, rate=2.0, burst=2, concurrency=1)
    assert limits.take(caller) == 0 and limits.take(caller) == 0
    assert limits.take(caller) == pytest.approx(0.5)
    now[0] += 0.5
    assert limits.take(caller) == 0
    assert limits.take(auth.Caller("free", None)) == 0  # no rate: unlimited
    assert limits.acquire(caller, "s1") and not limits.acquire(caller, "s2")
    limits.release("s1")
    limits.release("s2")  # never acquired: nothing to give back
    assert limits.open_streams("c") == 0 and limits.acquire(caller, "s3")


KEYS = "rated key-rated * rate=1 burst=1\nsingle key-single * concurrency=1\n"


def _md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _retry_hint(e: grpc.aio.AioRpcError) -> tuple[int, float]:
    trailers = dict(e.trailing_metadata())
    status = status_pb2.Status.FromString(trailers["grpc-status-details-bin"])
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    return int(trailers["retry-after-ms"]), info.retry_delay.ToTimedelta().total_seconds()


async def _exhausted(call) -> grpc.aio.AioRpcError:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        assert e.code() == Code.RESOURCE_EXHAUSTED, e
        return e
    raise AssertionError("the request was admitted")


async def _run(tiny_llama, tmp_path, monkeypatch) -> None:
    (tmp_path / "keys").write_text(KEYS)
    keys = ["--api-keys-file", str(tmp_path / "keys")]
    async with (
        pod_in_process(tiny_llama, "tiny") as pod,
        gateway_in_process(["--pods", f"127.0.0.1:{pod.port}", *keys, "--http-port", str(free_port())]) as gw,
        grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch,
    ):
        stub = generation_pb2_grpc.GenerationStub(ch)
        short = token_request([5, 6, 7], 2, temperature=0.0)
        assert len([r async for r in stub.Generate(short, metadata=_md("key-rated"), timeout=20)]) > 0
        e = await _exhausted(stub.Generate(short, metadata=_md("key-rated"), timeout=20))
        ms, delay = _retry_hint(e)
        assert 0 < ms <= 1000 and delay == pytest.approx(ms / 1000) and "rate limit" in e.details()
        with pytest.raises(grpc.aio.AioRpcError) as abort:  # a cancel is not metered: it is answered
            await stub.Abort(pb.AbortRequest(request_id="gone"), metadata=_md("key-rated"), timeout=5)
        assert abort.value.code() == Code.NOT_FOUND

        first = stub.Generate(token_request([5, 6, 7], 500), metadata=_md("key-single"), timeout=30)
        await first.read()  # the stream is open and holds the key's only slot
        e = await _exhausted(stub.Generate(short, metadata=_md("key-single"), timeout=20))
        assert "streams open" in e.details() and _retry_hint(e)[0] > 0
        first.cancel()
        while gw.limits.open_streams("single"):
            await asyncio.sleep(0.01)
        assert len([r async for r in stub.Generate(short, metadata=_md("key-single"), timeout=20)]) > 0
        await _http_callers_without_a_key_are_refused_before_their_body_is_read(gw.http_port, monkeypatch)


async def _http_callers_without_a_key_are_refused_before_their_body_is_read(port: int, monkeypatch) -> None:
    """The HTTP front parsed the body (up to 64 MB: seconds of the gateway's one event loop, every
    caller's streams stalled) before the servicer looked at the key; now the key comes first."""
    parsed: list[int] = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda b, **kw: parsed.append(len(b)) or loads(b, **kw))
    big = json.dumps({"prompt": [[5, 6, 7]] * 20_000, "max_tokens": 1}).encode()
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with httpx.AsyncClient(timeout=20) as http:
        for headers in (
            {},
            {"authorization": "Bearer nope"},
            {"x-api-key": "key-single"} | {"authorization": "Bearer x"},
        ):
            answer = await http.post(url, content=big, headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "UNAUTHENTICATED"
        assert len(big) not in parsed
        small = {"prompt": [5, 6, 7], "max_tokens": 2, "model": "tiny"}
        answer = await http.post(url, json=small, headers={"x-api-key": "key-single"})
        assert answer.status_code == 200, answer.text


def test_rate_and_concurrency_limits_answer_resource_exhausted_with_a_retry_hint(
    tiny_llama, tmp_path, monkeypatch
):
    asyncio.run(_run(tiny_llama, tmp_path, monkeypatch))
