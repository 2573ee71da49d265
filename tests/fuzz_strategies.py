"""Hypothesis strategies for hostile inputs to every Spindle RPC: edge numbers, NaN / inf, giant
and odd unicode strings, malformed token ids, path tricks. Shared by the fuzz tests; no servers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
from hypothesis import strategies as st

from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import generation_pb2 as pb
from spindle.v1 import model_control_pb2 as mc

Code = grpc.StatusCode
# What bad input may be answered with: the caller's fault, named. Never UNKNOWN or INTERNAL.
BAD_INPUT = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.OUT_OF_RANGE,
        Code.RESOURCE_EXHAUSTED,
        Code.FAILED_PRECONDITION,
        Code.ALREADY_EXISTS,
    }
)

int32 = st.one_of(
    st.sampled_from([0, 1, -1, 2, 255, 319, 320, 511, 512, 513, 49151, 49152, 2**31 - 1, -(2**31)]),
    st.integers(-(2**31), 2**31 - 1),
)
int64 = st.one_of(
    st.sampled_from([0, -1, 2**31, 2**63 - 1, -(2**63), 2**53 + 1]), st.integers(-(2**63), 2**63 - 1)
)
floats = st.one_of(
    st.sampled_from(
        [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, 1e-300, 5e-324, 1e308, -1e308, 2.0, 100.0]
    ),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-3, 3),
)
UNICODE_EDGES = [
    "",
    " ",
    "\x00",
    "\x00\x00abc",
    "\u202e\u202d",
    "\ufeff",
    "\ufffd",
    "\uffff",
    "\U0010ffff",
    "🙂",
    "👩\u200d👩\u200d👧",
    "e\u0301\u0301\u0301",
    "\r\n\t\x0b",
    "\u0000" * 17,
    "<|endoftext|>",
    "<|im_start|>",
    "../../etc/passwd",
    "%s%n%x",
    "' OR 1=1 --",
    "a" * 129,
    "\u0300" * 64,
]


def giant(unit: str, sizes: tuple[int, ...] = (4_096, 100_000, 1_000_000)) -> st.SearchStrategy[str]:
    return st.builds(lambda n: unit * n, st.sampled_from(sizes))


texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(UNICODE_EDGES),
    st.text(alphabet=st.characters(min_codepoint=0x300, max_codepoint=0x36F), max_size=30),
    giant("a"),
    giant("🙂 "),
)
names = st.one_of(
    st.sampled_from(UNICODE_EDGES),
    st.text(max_size=20),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True),
    st.sampled_from(["..", "a/../../b", "/abs", "a\\b", "@active", "a" * 300, "no-such-adapter"]),
    giant("n", (10_000, 1_000_000)),  # echoed in a message, past gRPC's 8 KiB limit on trailers
)
# Resolved now, at import: `from_regex` imports its module on first use, and under a draw deep
# in a gRPC test's stack CPython 3.11's parser once failed there ("AST constructor recursion
# depth mismatch", CI of 2026-12-01 p), a flake of the harness, not of the code under test.
names.validate()


def token_ids(vocab: int) -> st.SearchStrategy[list[int]]:
    near = st.integers(-3, vocab + 3)
    return st.one_of(
        st.lists(near, max_size=40),
        st.lists(int32, max_size=20),
        st.lists(st.integers(0, vocab - 1), min_size=400, max_size=700),
        st.builds(lambda n: [1] * n, st.sampled_from([100_000, 1_000_000])),
    )


@st.composite
def sampling(draw: st.DrawFn) -> pb.SamplingParams:
    s = pb.SamplingParams()
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "length_penalty",
    ):
        if draw(st.booleans()):
            setattr(s, name, draw(floats))
    for name in ("top_k", "num_beams"):
        if draw(st.booleans()):
            setattr(s, name, draw(st.one_of(int32, st.integers(0, 4))))
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if draw(st.booleans()):
            setattr(s, name, draw(st.booleans()))
    s.stop_token_ids.extend(draw(st.lists(st.one_of(int32, st.integers(0, 400)), max_size=4)))
    s.early_stopping = draw(st.sampled_from([0, 0, 0, 1, 2, 3, 4, 99, -1, 2**31 - 1]))
    return s


@st.composite
def generate_requests(draw: st.DrawFn, vocab: int, adapters: tuple[str, ...] = ()) -> pb.GenerateRequest:
    """Any GenerateRequest: one in three plausible (so accepted requests, their streams and their
    cancellation are fuzzed too), the rest hostile in every field."""
    if draw(st.integers(0, 2)) == 0:
        return draw(plausible_requests(vocab, adapters))
    req = pb.GenerateRequest(request_id=draw(st.one_of(st.just(""), names)))
    prompt = draw(st.sampled_from(["none", "text", "chat", "ids", "ids"]))
    if prompt == "text":
        req.text = draw(texts)
    elif prompt == "chat":
        roles = st.sampled_from(["user", "system", "assistant", "", "tool", "🙂"])
        for role, content in draw(st.lists(st.tuples(roles, texts), max_size=4)):
            req.chat.messages.add(role=role, content=content)
    elif prompt == "ids":
        req.token_ids.ids.extend(draw(token_ids(vocab)))
    if draw(st.integers(0, 3)):
        req.max_tokens = draw(st.one_of(st.integers(-2, 6), int32))
    if draw(st.integers(0, 3)) == 0:
        req.model = draw(names)
    if draw(st.integers(0, 2)) == 0:
        req.adapter = draw(st.one_of(names, st.sampled_from(adapters or ("x",))))
    req.stop.extend(draw(st.lists(st.one_of(texts, st.text(min_size=1, max_size=3)), max_size=3)))
    for name, values in (
        ("seed", int64),
        ("logprobs", st.one_of(int32, st.integers(-1, 21))),
        ("priority", int32),
    ):
        if draw(st.booleans()):
            setattr(req, name, draw(values))
    req.sampling.CopyFrom(draw(sampling()))
    if draw(st.integers(0, 3)) == 0:  # what a caller (or the gateway, after a pod failed) already has
        req.resume.output_token_ids.extend(draw(token_ids(vocab)))
        req.resume.text_chars = draw(st.one_of(int32, st.integers(-1, 4)))
    return req


@st.composite
def plausible_requests(draw: st.DrawFn, vocab: int, adapters: tuple[str, ...]) -> pb.GenerateRequest:
    """Mostly valid: odd but legal values (unicode text, stop strings of any length, seeds, logprobs)."""
    req = pb.GenerateRequest(max_tokens=draw(st.integers(1, 6)))
    if draw(st.booleans()):
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=60)))
    else:
        req.text = draw(st.one_of(st.text(min_size=1, max_size=60), st.sampled_from(UNICODE_EDGES[1:])))
    if adapters and draw(st.booleans()):
        req.adapter = draw(st.sampled_from(adapters))
    req.stop.extend(
        draw(st.lists(st.text(min_size=1, max_size=draw(st.sampled_from([1, 3, 50]))), max_size=3))
    )
    if draw(st.booleans()):
        req.seed = draw(st.integers(0, 2**63 - 1))
    if draw(st.booleans()):
        req.logprobs = draw(st.integers(0, 20))
    req.priority = draw(st.integers(-(2**31), 2**31 - 1))
    s = req.sampling
    s.temperature = draw(st.sampled_from([0.0, 0.0, 0.7, 1.0, 100.0]))
    s.top_p = draw(st.sampled_from([1.0, 0.9, 5e-324]))
    s.top_k = draw(st.sampled_from([0, 1, 5, 2**31 - 1]))
    s.min_p = draw(st.sampled_from([0.0, 0.5, 1.0]))
    s.repetition_penalty = draw(st.sampled_from([1.0, 1.3, 1e-300, 1e300]))
    s.presence_penalty = draw(st.sampled_from([0.0, -2.0, 2.0]))
    s.frequency_penalty = draw(st.sampled_from([0.0, -2.0, 2.0]))
    s.ignore_eos = draw(st.booleans())
    s.stop_token_ids.extend(draw(st.lists(st.integers(0, vocab - 1), max_size=3)))
    if draw(st.integers(0, 4)) == 0:
        req.resume.output_token_ids.extend(draw(st.lists(st.integers(0, vocab - 1), max_size=3)))
    return req


paths = st.one_of(
    names, st.sampled_from(["/", "/etc", "/dev/zero", "/proc/self/mem", "/tmp", ".", "~", "\x00/x"])
)
peers = st.one_of(st.sampled_from(["127.0.0.1:1", "localhost:0", "", "::::", "unix:/nonexistent"]), names)
sha = st.one_of(st.just(""), st.text(alphabet="0123456789abcdefABCDEF", min_size=0, max_size=70), names)

control_requests = {
    "LoadAdapter": st.builds(
        lambda n, slot, p: mc.LoadAdapterRequest(
            name=n, **({"slot": slot} if slot is not None else {}), **({"path": p} if p is not None else {})
        ),
        names,
        st.none() | int32 | st.integers(-1, 3),
        st.none() | paths,
    ),
    "PromoteFromDisk": st.builds(lambda n, p: mc.PromoteFromDiskRequest(name=n, path=p), names, paths),
    "PromoteFromPeer": st.builds(
        lambda n, p, s: mc.PromoteFromPeerRequest(name=n, peer=p, sha256=s), names, peers, sha
    ),
    "Rotate": st.builds(
        lambda n, src, s: mc.RotateRequest(name=n, sha256=s, **src),
        names,
        st.one_of(st.just({}), paths.map(lambda p: {"path": p}), peers.map(lambda p: {"peer": p})),
        sha,
    ),
    "Evict": st.builds(
        lambda n, h, d: mc.EvictRequest(name=n, from_host=h, from_disk=d), names, st.booleans(), st.booleans()
    ),
    "Pin": st.builds(lambda n, p: mc.PinRequest(name=n, pinned=p), names, st.booleans()),
    "SetActive": st.builds(lambda n: mc.SetActiveRequest(name=n), names),
    "GetSlots": st.just(mc.GetSlotsRequest()),
    "FetchAdapterWeights": st.builds(
        lambda n, c: mc.FetchAdapterWeightsRequest(name=n, chunk_bytes=c), names, int32
    ),
    # only refusable drains: a valid one would drain the pod under test
    "Drain": st.builds(
        lambda t, e: mc.DrainRequest(timeout_seconds=t, exit=e),
        st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=3600.0001), st.just(math.nan)),
        st.booleans(),
    ),
}

adapter_requests = {
    "Import": st.builds(
        lambda n, u, s: apb.ImportRequest(name=n, uri=u, sha256=s),
        names,
        st.one_of(
            texts,
            st.builds(lambda b, k: f"s3://{b}/{k}", st.sampled_from(["spindle-test", "nope", ""]), names),
        ),
        sha,
    ),
    "Get": st.builds(lambda n: apb.GetAdapterRequest(name=n), names),
    "List": st.builds(lambda s, t: apb.ListAdaptersRequest(page_size=s, page_token=t), int32, names),
    "Delete": st.builds(lambda n: apb.DeleteAdapterRequest(name=n), names),
    "Pin": st.builds(lambda n, p: apb.PinAdapterRequest(name=n, pinned=p), names, st.booleans()),
    "Place": st.builds(
        lambda a, hints: apb.PlaceRequest(adapter=a, pods=hints),
        names,
        st.lists(
            st.builds(
                lambda a, w, k, r, m: apb.PodHint(
                    address=a, num_waiting=w, kv_usage=k, resident_adapters=r, max_adapters=m
                ),
                peers,
                int32,
                floats.map(lambda f: f if abs(f) < 3e38 or math.isnan(f) else math.inf),
                int32,
                int32,
            ),
            max_size=4,
        ),
    ),
    "Catalog": st.just(apb.CatalogRequest()),
}


@st.composite
def register_streams(draw: st.DrawFn) -> list[apb.RegisterChunk]:
    """A Register call's messages: headers that lie, chunks out of order, truncated or oversized data."""
    header = apb.RegisterHeader(
        name=draw(names),
        config_json=draw(
            st.one_of(st.binary(max_size=40), st.sampled_from([b"{}", b"[]", b"null", b'{"r": -1}']))
        ),
        total_bytes=draw(st.one_of(int64, st.integers(-1, 64))),
        sha256=draw(sha),
        description=draw(texts),
    )
    data = [apb.RegisterChunk(data=b) for b in draw(st.lists(st.binary(max_size=64), max_size=3))]
    layout = draw(st.sampled_from(["header-first", "no-header", "two-headers", "empty"]))
    if layout == "empty":
        return []
    first = [apb.RegisterChunk(header=header)]
    if layout == "no-header":
        return data or [apb.RegisterChunk(data=b"")]
    if layout == "two-headers":
        return first + data + first
    return first + data


# --- the gateway's own inputs: API keys, other metadata, deadlines ---------------------------------

printable = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)
METADATA_LIMIT = 7_000  # about where gRPC's 8 KiB soft limit on a call's metadata starts to refuse


@dataclass(frozen=True)
class Auth:
    """A call's metadata and the caller the gateway must see in it (None: no valid key)."""

    metadata: tuple[tuple[str, str | bytes], ...]
    caller: str | None
    size: int  # bytes: above METADATA_LIMIT the transport may refuse the call (RESOURCE_EXHAUSTED)


def _key_headers(keys: dict[str, str]) -> st.SearchStrategy[tuple[str, str | bytes]]:
    """One header that offers a key, valid or not, or looks like one (`authorization` without
    `Bearer ` and `-bin` headers are not keys: `_caller_of` reads what a call's headers name)."""
    valid = st.sampled_from(sorted(keys))
    return st.one_of(
        valid.map(lambda k: ("authorization", f"Bearer {k}")),
        valid.map(lambda k: ("authorization", f"bEaReR   {k}  ")),
        valid.map(lambda k: ("x-api-key", k)),
        valid.map(lambda k: ("x-api-key", k.upper())),
        valid.map(lambda k: ("authorization", k)),
        valid.map(lambda k: ("x-api-key-bin", k.encode())),
        printable.map(lambda k: ("authorization", f"Bearer {k}")),
        printable.map(lambda k: ("x-api-key", k)),
        st.sampled_from(
            [
                ("authorization", "Bearer "),
                ("x-api-key", ""),
                ("authorization", "Basic a2V5LWFkbWlu"),
                ("authorization-bin", b"\xff\x00\xfe"),
            ]
        ),
    )


_NOISE_VALUES = [
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # a valid W3C traceparent
    "00-" + "0" * 32 + "-" + "0" * 16 + "-00",  # all-zero ids: invalid
    "ff-zz-zz-zz",
    "k=v,k2=v2;p=1",
    "1S",
    "-1S",
    "99999999H",
    "127.0.0.1:1",
    "@active",
]
_NOISE_KEYS = ["x-request-id", "traceparent", "tracestate", "baggage", "grpc-timeout", "user-agent",
               "x-spindle-pod", "x-adapter", "x-forwarded-for", "cookie"]  # fmt: skip
_noise = st.one_of(
    st.tuples(st.sampled_from(_NOISE_KEYS), st.one_of(printable, st.sampled_from(_NOISE_VALUES))),
    st.tuples(st.sampled_from(["trace-bin", "x-blob-bin"]), st.binary(max_size=64)),
)


@st.composite
def api_key_metadata(draw: st.DrawFn, keys: dict[str, str]) -> Auth:
    """Metadata a client may send (gRPC refuses non-ASCII, upper-case or CR/LF metadata before it
    leaves: tests/raw_http2.py sends those): no key, empty, huge, wrong, several, a -bin twin,
    tracing and routing-looking noise, hundreds of headers. `keys`: key -> caller name."""
    headers = draw(st.lists(st.one_of(_key_headers(keys), _noise), max_size=6))
    if draw(st.booleans()):  # half the calls end with a good key, so the request goes further
        key = draw(st.sampled_from(sorted(keys)))
        headers.append(("authorization", f"Bearer {key}"))
    rare = draw(st.integers(0, 19))
    if rare == 0:  # a huge key: gRPC refuses a call's metadata past 8 KiB (at times), 16 KiB (always)
        n = draw(st.sampled_from([1_000, 7_000, 9_000, 20_000]))
        headers.insert(draw(st.integers(0, len(headers))), ("x-api-key", "k" * n))
    elif rare == 1:  # hundreds of headers
        at = draw(st.integers(0, len(headers)))
        headers[at:at] = [("x-noise", str(i)) for i in range(draw(st.sampled_from([50, 300])))]
    sent = tuple(headers)
    return Auth(sent, _caller_of(sent, keys), sum(len(k) + len(v) + 32 for k, v in sent))


def _caller_of(headers: tuple[tuple[str, str | bytes], ...], keys: dict[str, str]) -> str | None:
    """The caller a call's headers name: its one key (RFC 6750: one method a request), from
    `authorization: Bearer KEY` (any case, spaces trimmed) or `x-api-key`; blank values offer
    none, the same key twice is one; two different keys, or none valid, name no caller."""
    offered = set()
    for name, value in headers:
        if isinstance(value, str) and name == "authorization" and value.lower().startswith("bearer "):
            offered.add(value[7:].strip())
        elif isinstance(value, str) and name == "x-api-key":
            offered.add(value.strip())
    offered.discard("")
    return keys.get(offered.pop()) if len(offered) == 1 else None


# seconds; None: no deadline. <= 0 and tiny ones expire before or while the call runs.
deadlines = st.sampled_from([None, None, None, 60.0, 5.0, 0.5, 0.05, 1e-3, 1e-6, 0.0, -1.0, 1e9])
