"""`spindle adapter-service`: adapters registered once for the cluster, placed on pods on demand.

Serves three gRPC services on one port: Adapters (the admin API; users reach it through the
gateway with an admin-scoped key), Placement (for the gateway), and ModelControl's
FetchAdapterWeights only, so a pod promotes an adapter "from a peer" that is this service and
needs no S3 credentials. Storage is S3 (`--s3-bucket`) or, embedded, a local directory; the
registry is Redis (`--redis-url`) or, embedded, this process's memory. Health is SERVING while
both answer (checked every second, each check within 2 s), NOT_SERVING while either does not.

Several replicas may serve one cluster, sharing Redis and S3: registrations of a name are
serialised by a lease and versions assigned by a Redis script (adapter_service/registration.py),
placements and the policy loop decided once (adapter_service/leases.py). Every storage and
registry call and every admin RPC is bounded (adapter_service/deadlines.py).

An upload is validated completely (adapter_service/validate.py) and its sha256 compared before
anything is written; a refused upload leaves nothing in storage or the registry.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from adapter_service import base_model, deadlines, validate
from adapter_service.backend_errors import (
    S3_DOWN,
    admin_rpcs_bounded,
    bounded_after_upload,
    unavailable_when_backends_are_down,
)
from adapter_service.controller import Controller, PlacementError
from adapter_service.placement import Knobs
from adapter_service.registration import LeaseLost, register
from adapter_service.registry import MemoryRegistry, RedisRegistry, Registry
from adapter_service.store import LocalStore, S3Store, Store, Version
from gateway.pods import check_target, dns_discovery, static_discovery
from spindle import flagtypes, redis_client, serving, telemetry
from spindle.errors import ConfigError
from spindle.grpc_status import abort
from spindle.security import add_security_args, security_from_args
from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import adapters_pb2_grpc, model_control_pb2, model_control_pb2_grpc

log = logging.getLogger("spindle.adapters")
Code = grpc.StatusCode
SERVICES = ("spindle.v1.Adapters", "spindle.v1.Placement", "spindle.v1.ModelControl")
_MAX_CONFIG = 1 << 20
_CHUNK = 1 << 20
_DRAIN_BYTES = 64 << 20
_MAX_PAGE = 1000  # adapters in one List answer
_MAX_PAGE_BYTES = 3 << 20  # one List answer: under the 4 MiB that gRPC clients receive by default
_MAX_DESCRIPTION = 4096  # bytes (UTF-8): every Get and List answer carries it
SHUTDOWN_GRACE_S = 5.0  # in-flight RPCs finish within it at SIGTERM; the whole exit gets 10 s more


async def _name(context: grpc.aio.ServicerContext, name: str) -> str:
    try:
        return validate.check_name(name)
    except validate.ValidationError as e:
        await abort(context, Code.INVALID_ARGUMENT, str(e))


class _Refused(Exception):
    """An upload refused before it was stored: the status to answer with once it is drained."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


async def _receive(h: apb.RegisterHeader, chunks: AsyncIterator[apb.RegisterChunk]) -> Path:
    """The announced weights, checked for size and sha256, in a temporary file the caller removes."""
    fd, tmp = tempfile.mkstemp(prefix="spindle-upload-")
    path = Path(tmp)
    try:
        digest, received = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            async for chunk in chunks:
                if chunk.WhichOneof("kind") != "data":
                    raise _Refused(Code.INVALID_ARGUMENT, "only the first message may be a header")
                received += len(chunk.data)
                if received > h.total_bytes:
                    raise _Refused(
                        Code.INVALID_ARGUMENT, f"more than the announced {h.total_bytes} bytes were sent"
                    )
                digest.update(chunk.data)
                out.write(chunk.data)
        if received != h.total_bytes:
            raise _Refused(Code.INVALID_ARGUMENT, f"received {received} bytes, announced {h.total_bytes}")
        if digest.hexdigest() != h.sha256:
            raise _Refused(
                Code.DATA_LOSS,
                f"the weights received have sha256 {digest.hexdigest()}, the client said {h.sha256}: "
                "corrupted in transit; nothing was stored, send again",
            )
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


async def _drain(chunks: AsyncIterator[apb.RegisterChunk]) -> None:
    """Read what the client still sends of a refused upload (up to `_DRAIN_BYTES`) before the
    refusal goes out. A grpc.aio client still sending when the status arrives reports INTERNAL
    "Internal error from Core" in its place (grpc/aio/_call.py `_write`), so without this the
    gateway's relay, or any asyncio client, lost the reason ("name not allowed", "more than the
    announced bytes"). Past the bound the refusal goes out at once: a client sending gigabytes
    after a refused header gets the INTERNAL and the service's log the reason."""
    drained = 0
    async for chunk in chunks:
        drained += len(chunk.data)
        if drained > _DRAIN_BYTES:
            return


def _within_bytes(adapters: list[apb.Adapter], limit: int) -> int:
    """How many of `adapters` (at least one) one answer holds within `limit` bytes: a page of
    1,000 with 4 KiB descriptions and their placements was past the 4 MiB that gRPC clients
    receive by default, and failed RESOURCE_EXHAUSTED for every caller. A page may hold fewer
    than asked (AIP-158)."""
    used = 0
    for i, a in enumerate(adapters):
        used += a.ByteSize() + 8  # the field's tag and length
        if used > limit and i > 0:
            return i
    return len(adapters)


def _description_refusal(description: str) -> str | None:
    if len(description.encode()) <= _MAX_DESCRIPTION:
        return None
    return f"description is {len(description.encode())} bytes; at most {_MAX_DESCRIPTION}"


@admin_rpcs_bounded
class AdaptersService(adapters_pb2_grpc.AdaptersServicer):
    def __init__(
        self,
        controller: Controller,
        base: base_model.BaseModel,
        max_rank: int,
        max_adapter_bytes: int,
        s3_import: S3Store | None = None,
    ) -> None:
        self.c, self.base, self.max_rank = controller, base, max_rank
        self.max_bytes, self.s3_import = max_adapter_bytes, s3_import

    async def _proto(self, v: Version, placements: list[apb.PodPlacement] | None = None) -> apb.Adapter:
        """`placements`: read by the caller (a List page reads them all at once), else here."""
        if placements is None:
            placements = (await self.c.placements([v.name]))[v.name]
        return apb.Adapter(
            name=v.name,
            version=v.version,
            sha256=v.sha256,
            size_bytes=v.size_bytes,
            rank=v.rank,
            target_modules=v.target_modules,
            base_model=v.base_model,
            created_at=v.created_at,
            pinned=v.pinned,
            description=v.description,
            placements=placements,
        )

    async def _get(self, name: str, context: grpc.aio.ServicerContext) -> Version:
        v = await self.c.lookup(await _name(context, name))
        if v is None:
            await abort(context, Code.NOT_FOUND, f"adapter {name!r} is not registered")
        return v

    async def _commit(
        self,
        context: grpc.aio.ServicerContext,
        name: str,
        config: bytes,
        weights: Path,
        sha: str,
        description: str,
    ) -> Version:
        """Validate, then store (the source of truth) and index; a refusal writes nothing."""
        began = time.monotonic()
        try:
            summary = await asyncio.to_thread(validate.validate, config, weights, self.base, self.max_rank)
        except validate.ValidationError as e:
            await abort(context, Code.INVALID_ARGUMENT, f"adapter {name!r} refused: {e}")

        def describe(number: int, latest: Version | None) -> Version:
            return Version(
                name=name,
                version=number,
                sha256=sha,
                size_bytes=weights.stat().st_size,
                rank=summary.rank,
                target_modules=summary.target_modules,
                base_model=self.base.name,
                created_at=time.time(),
                description=description,
                pinned=latest.pinned if latest else False,
            )

        try:
            done = await register(self.c, self.c.leases, name, sha, config, weights, describe)
        except LeaseLost as e:
            await abort(
                context,
                Code.UNAVAILABLE,
                f"{e}; not registered unless a retry with the same weights answers ALREADY_EXISTS "
                "(a retry never makes a second version)",
            )
        v = done.version
        if not done.new:
            await abort(
                context,
                Code.ALREADY_EXISTS,
                f"adapter {name!r} version {v.version} has these weights already",
            )
        if v.size_bytes <= self.c.staging_max_bytes:
            await self.c.stage(sha, config, await asyncio.to_thread(weights.read_bytes))
        log.info(
            "registered %s v%d (rank %d, %d bytes) in %.2f s",
            *(name, v.version, v.rank, v.size_bytes, time.monotonic() - began),
        )
        return v

    async def _rotated(self, v: Version, seconds: float) -> None:
        """Rotate the pods holding `v`'s name, for at most `seconds`: `v` is registered already,
        so running out of time is no failure (the policy leader rotates what is left). Version 1
        too: a name deleted and registered again starts at 1, and a pod that kept the deleted
        weights (unreachable during the Delete) served them for the new registration until the
        leader's late rotation, a lease TTL after the acknowledgement."""
        try:
            await asyncio.wait_for(self.c.rotate(v), max(seconds, 0.1))
        except asyncio.TimeoutError:
            log.warning("rotating the pods to %s v%d goes on under the policy leader", v.name, v.version)

    @bounded_after_upload
    async def Register(
        self, request_iterator: AsyncIterator[apb.RegisterChunk], context: grpc.aio.ServicerContext
    ) -> apb.Adapter:
        chunks = aiter(request_iterator)
        try:
            h = self._header(await anext(chunks, None))
            path = await _receive(h, chunks)
        except _Refused as e:
            await _drain(chunks)
            await abort(context, e.code, e.message)
        started = time.monotonic()
        try:
            commit = self._commit(context, h.name, bytes(h.config_json), path, h.sha256, h.description)
            v = await deadlines.within(self.c.bounds.rpc, commit)
        finally:
            path.unlink(missing_ok=True)
        await self._rotated(v, self.c.bounds.rpc - (time.monotonic() - started))
        return await self._proto(v)

    def _header(self, first: apb.RegisterChunk | None) -> apb.RegisterHeader:
        if first is None or first.WhichOneof("kind") != "header":
            raise _Refused(
                Code.INVALID_ARGUMENT, "the first message must be the header (name, config, size, sha256)"
            )
        h = first.header
        try:
            validate.check_name(h.name)
        except validate.ValidationError as e:
            raise _Refused(Code.INVALID_ARGUMENT, str(e)) from None
        if len(h.sha256) != 64 or any(c not in "0123456789abcdef" for c in h.sha256):
            raise _Refused(
                Code.INVALID_ARGUMENT, "sha256 must be the 64 lowercase hex digits of the weights file"
            )
        if not 0 < h.total_bytes <= self.max_bytes:
            raise _Refused(
                Code.OUT_OF_RANGE if h.total_bytes > 0 else Code.INVALID_ARGUMENT,  # retrying cannot help
                f"total_bytes {h.total_bytes} must be in [1, {self.max_bytes}] (--max-adapter-bytes)"
                + (
                    f": {h.total_bytes - self.max_bytes} bytes too many"
                    if h.total_bytes > self.max_bytes
                    else ""
                ),
            )
        if not h.config_json or len(h.config_json) > _MAX_CONFIG:
            raise _Refused(Code.INVALID_ARGUMENT, f"config_json must be 1 byte to {_MAX_CONFIG} bytes")
        if refusal := _description_refusal(h.description):
            raise _Refused(Code.INVALID_ARGUMENT, refusal)
        return h

    async def Import(self, request: apb.ImportRequest, context: grpc.aio.ServicerContext) -> apb.Adapter:
        started = time.monotonic()
        name = await _name(context, request.name)
        if refusal := _description_refusal(request.description):
            await abort(context, Code.INVALID_ARGUMENT, refusal)
        if self.s3_import is None:
            await abort(
                context, Code.FAILED_PRECONDITION, "Import needs S3: start the service with --s3-bucket"
            )
        try:
            with deadlines.waiting_for(f"storage (S3) reading {request.uri}"):
                config, path = await asyncio.to_thread(self.s3_import.fetch_uri, request.uri, self.max_bytes)
        except ValueError as e:
            await abort(context, Code.INVALID_ARGUMENT, str(e))
        except OverflowError as e:  # larger than --max-adapter-bytes: retrying cannot help
            await abort(context, Code.OUT_OF_RANGE, str(e))
        except S3_DOWN as e:
            await abort(context, Code.UNAVAILABLE, f"storage (S3) is unreachable, retry: {e}")
        except Exception as e:  # botocore's ClientError: missing object, access denied
            await abort(context, Code.NOT_FOUND, f"cannot read {request.uri}: {e}")
        try:
            sha = await asyncio.to_thread(lambda: hashlib.sha256(path.read_bytes()).hexdigest())
            if request.sha256 and request.sha256 != sha:
                await abort(
                    context, Code.DATA_LOSS, f"{request.uri} has sha256 {sha}, expected {request.sha256}"
                )
            v = await self._commit(context, name, config, path, sha, request.description)
        finally:
            path.unlink(missing_ok=True)
        # Import is bounded as a whole (its download too): the rotation gets what is left of it.
        await self._rotated(v, self.c.bounds.rpc - (time.monotonic() - started) - 0.5)
        return await self._proto(v)

    async def Get(self, request: apb.GetAdapterRequest, context: grpc.aio.ServicerContext) -> apb.Adapter:
        return await self._proto(await self._get(request.name, context))

    async def List(
        self, request: apb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> apb.ListAdaptersResponse:
        """By name, `page_size` at a time (0: 100); above the most, 1,000, it is coerced to it, as
        AIP-158 asks (it was refused). A page's placements are read in one round trip: three a
        name made a page of 1,000 take 3,000 round trips."""
        if request.page_size < 0:
            await abort(
                context, Code.INVALID_ARGUMENT, f"page_size must not be negative, got {request.page_size}"
            )
        if request.page_token:
            await _name(context, request.page_token)
        size = min(request.page_size or 100, _MAX_PAGE)
        await self.c.ensure_built()
        page = await self.c.registry.page(request.page_token, size + 1)
        more = len(page) > size
        page = page[:size]
        placements = await self.c.placements([v.name for v in page])
        adapters = [await self._proto(v, placements[v.name]) for v in page]
        kept = _within_bytes(adapters, _MAX_PAGE_BYTES)
        more = more or kept < len(adapters)
        return apb.ListAdaptersResponse(
            adapters=adapters[:kept], next_page_token=adapters[kept - 1].name if more else ""
        )

    async def Delete(
        self, request: apb.DeleteAdapterRequest, context: grpc.aio.ServicerContext
    ) -> apb.DeleteAdapterResponse:
        name = await _name(context, request.name)
        async with self.c.leases.hold(f"register:{name}", f"a registration of {name!r}"):
            await self._deletable(name, context)
            await self.c.registry.remove(name)  # first: no new placement starts from here on
            await self.c.evict_everywhere(name)
            try:
                n = await self.c.store.remove(name)
            except Exception as e:  # storage is the truth: the next rebuild would bring it back
                log.exception("deleting %s from storage failed", name)
                await abort(
                    context,
                    Code.UNAVAILABLE,
                    f"storage failed; {name!r} is no longer served but its files remain: retry the "
                    f"Delete: {e}",
                )
        log.info("deleted %s (%d version%s)", name, n, "s" if n != 1 else "")
        return apb.DeleteAdapterResponse(versions_deleted=n)

    async def _deletable(self, name: str, context: grpc.aio.ServicerContext) -> None:
        """NOT_FOUND unless the index or storage has `name`. Storage too: a Delete unindexes
        first, so when storage then failed (or the RPC ran out of time) its retry found nothing
        indexed and answered NOT_FOUND, leaving the files to come back at the next rebuild."""
        if await self.c.lookup(name) is None and not await self.c.store.versions(name, latest=True):
            await abort(context, Code.NOT_FOUND, f"adapter {name!r} is not registered")

    async def Pin(self, request: apb.PinAdapterRequest, context: grpc.aio.ServicerContext) -> apb.Adapter:
        async with self.c.leases.hold(f"register:{request.name}", f"a registration of {request.name!r}"):
            v = await self._get(request.name, context)  # the latest, read under the name's lease
            await self.c.store.set_pinned(v.name, request.pinned)
            v.pinned = request.pinned
            await self.c.registry.put(v)
        await self.c.pin(v.name, request.pinned)
        return await self._proto(v)


@unavailable_when_backends_are_down
class PlacementService(adapters_pb2_grpc.PlacementServicer):
    def __init__(self, controller: Controller) -> None:
        self.c = controller

    async def Place(self, request: apb.PlaceRequest, context: grpc.aio.ServicerContext) -> apb.PlaceResponse:
        name = await _name(context, request.adapter)
        try:
            return await self.c.place(name, list(request.pods))
        except PlacementError as e:
            await abort(context, e.code, str(e))

    async def Catalog(
        self, request: apb.CatalogRequest, context: grpc.aio.ServicerContext
    ) -> apb.CatalogResponse:
        await self.c.ensure_built()
        latest = await self.c.latest()
        holders = self.c.holders(latest)  # the last polls, not the leases: the gateway asks often
        return apb.CatalogResponse(
            adapters=[
                apb.CatalogEntry(name=name, version=v.version, sha256=v.sha256, pods=holders.get(name, []))
                for name, v in sorted(latest.items())
            ]
        )


@unavailable_when_backends_are_down
class WeightsService(model_control_pb2_grpc.ModelControlServicer):
    """Only FetchAdapterWeights: the pods' peer-to-peer stream, answered from staging or storage."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    async def FetchAdapterWeights(
        self, request: model_control_pb2.FetchAdapterWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[model_control_pb2.AdapterWeightsChunk]:
        name = await _name(context, request.name)
        if not 0 <= request.chunk_bytes <= 16 << 20:
            await abort(context, Code.INVALID_ARGUMENT, "chunk_bytes must be in [0, 16 MiB]")
        try:
            config, data, v, _ = await self.c.weights(name)
        except PlacementError as e:
            await abort(context, e.code, str(e))
        step = request.chunk_bytes or _CHUNK
        for offset in range(0, max(len(data), 1), step):
            first, last = offset == 0, offset + step >= len(data)
            yield model_control_pb2.AdapterWeightsChunk(
                name=name,
                config_json=config.decode() if first else "",
                total_bytes=len(data) if first else 0,
                offset=offset,
                data=data[offset : offset + step],
                last=last,
                sha256=v.sha256 if last else "",
            )


# --- the command ------------------------------------------------------------------------------


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.description = "Run the adapter service: register adapters once, place them on model pods."
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to listen on; 0.0.0.0 or :: = every address, IPv4 and IPv6 [0.0.0.0]",
    )
    g.add_argument("--port", type=flagtypes.port, default=50060, help="gRPC port [50060]")
    g.add_argument(
        "--metrics-port", type=flagtypes.port, default=9091, help="Prometheus /metrics port; 0 = off [9091]"
    )
    g.add_argument(
        "--log-level", type=flagtypes.log_level, default="INFO", help="DEBUG, INFO, WARNING, ERROR [INFO]"
    )
    g.add_argument(
        "--advertise-address",
        default="",
        help="HOST:PORT at which pods reach this service's weight stream [--host:--port, or this host's IP]",
    )
    s = parser.add_argument_group("storage (S3, or embedded: a local directory)")
    s.add_argument("--s3-bucket", default="", help="bucket of the adapters; empty = the local --storage-dir")
    s.add_argument(
        "--s3-prefix", default="adapters/", help="key prefix in the bucket, a folder: ends with / [adapters/]"
    )
    s.add_argument("--s3-endpoint-url", default="", help="S3-compatible endpoint (MinIO, ...); empty = AWS")
    s.add_argument("--s3-region", default="", help="the bucket's region; empty = boto3's default")
    s.add_argument(
        "--storage-dir", default="", help="the embedded store's directory [~/.cache/spindle/adapters]"
    )
    r = parser.add_argument_group("registry (Redis, or embedded: this process)")
    r.add_argument(
        "--redis-url",
        default="",
        help="redis://HOST:PORT/DB; empty = in-process (password: in the URL or SPINDLE_REDIS_PASSWORD)",
    )
    r.add_argument(
        "--staging-max-bytes",
        type=flagtypes.at_least(0),
        default=256 << 20,
        help="hot copies of weights [256 MiB]",
    )
    p = parser.add_argument_group("model pods (their ModelControl addresses)")
    p.add_argument("--pods", default="", help="static list HOST:PORT,HOST:PORT of the pods' control ports")
    p.add_argument(
        "--pods-dns", default="", help="HOST:PORT of a headless Service of the pods' control ports"
    )
    p.add_argument(
        "--poll-interval", type=flagtypes.seconds, default=2.0, help="seconds between pod slot polls [2]"
    )
    p.add_argument(
        "--lease-ttl",
        type=flagtypes.seconds,
        default=10.0,
        help="seconds a pod's placement lease lives, and a replica's lease on a name or the policy loop [10]",
    )
    v = parser.add_argument_group("validation")
    v.add_argument(
        "--base-model",
        default="smollm2-135m-instruct",
        help="what uploads must fit: an alias, an HF config dir or a .gguf [smollm2-135m-instruct]",
    )
    v.add_argument(
        "--max-adapter-bytes",
        type=flagtypes.at_least(1),
        default=1 << 30,
        help="largest weights file [1 GiB]",
    )
    v.add_argument(
        "--max-lora-rank",
        type=flagtypes.at_least(1),
        default=64,
        help="refuse adapters of a higher rank [64]",
    )
    k = parser.add_argument_group("policy (see docs/adapter_service.md)")
    k.add_argument(
        "--spread-threshold",
        type=flagtypes.positive,
        default=8.0,
        help="running requests per holder that add a pod [8]",
    )
    k.add_argument(
        "--max-replicas",
        type=flagtypes.at_least(1),
        default=4,
        help="most pods a hot adapter is spread to [4]",
    )
    k.add_argument(
        "--hot-share",
        type=flagtypes.share,
        default=0.02,
        help="share of recent requests above which an adapter is hot: one pod per this share [0.02]",
    )
    k.add_argument(
        "--popularity-half-life",
        type=flagtypes.seconds,
        default=120.0,
        help="seconds after which an adapter's request counts weigh half [120]",
    )
    k.add_argument(
        "--slot-idle-seconds",
        type=flagtypes.seconds_or_none,
        default=300.0,
        help="idle device slot -> host [300]",
    )
    k.add_argument(
        "--host-idle-seconds",
        type=flagtypes.seconds_or_none,
        default=1800.0,
        help="idle host copy -> disk [1800]",
    )
    k.add_argument(
        "--disk-idle-seconds",
        type=flagtypes.seconds_or_none,
        default=86400.0,
        help="idle disk copy -> forgotten (storage only) [86400]",
    )
    deadlines.add_args(parser)
    add_security_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    serving.setup_logging(args.log_level)
    if args.pods and args.pods_dns:
        raise ConfigError("give at most one of --pods and --pods-dns")
    return asyncio.run(serve(args))


def _advertise(args: argparse.Namespace, port: int) -> str:
    """What pods dial for weights: --advertise-address, else --host, else (the wildcard) this
    host's own address."""
    if args.advertise_address:
        return args.advertise_address
    host = args.host if args.host not in serving.WILDCARD_HOSTS else _own_address()
    return serving.host_port(host, port)


def _own_address() -> str:
    """The address this host's name resolves to, an IPv4 one if it has one (as before), else IPv6.
    gethostbyname looked up IPv4 alone: on an IPv6 single-stack cluster, where the pod's name has
    only its IPv6 address, the service exited at start with a gaierror traceback."""
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ConfigError(
            f"this host's name {name!r} resolves to no address ({e}); give --advertise-address HOST:PORT"
        ) from e
    ipv4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    return (ipv4 or [i[4][0] for i in infos])[0]


def _backends(args: argparse.Namespace, bounds: deadlines.Bounds) -> tuple[Store, Registry]:
    """Storage and registry as the flags say; a setting they refuse is a ConfigError naming its flag
    (a --storage-dir that is a file, a --redis-url without a scheme were tracebacks)."""
    try:
        if args.s3_bucket:
            store: Store = S3Store(
                args.s3_bucket, args.s3_prefix, args.s3_endpoint_url, args.s3_region, bounds
            )
        else:
            store = LocalStore(args.storage_dir or Path.home() / ".cache" / "spindle" / "adapters")
    except (OSError, ValueError) as e:
        raise ConfigError(f"--{'s3-bucket' if args.s3_bucket else 'storage-dir'}: {e}") from e
    password = redis_client.env_password()
    try:
        registry: Registry = (
            RedisRegistry(args.redis_url, password, bounds=bounds) if args.redis_url else MemoryRegistry()
        )
    except ValueError as e:
        raise ConfigError(f"--redis-url: {e}") from e
    return store, registry


async def serve(args: argparse.Namespace) -> int:
    provider = telemetry.tracer_provider_from_env("spindle-adapter-service")
    server, health, controller = await start(args, provider)
    if args.metrics_port:
        async with serving.stopped_on_failure(lambda: server.stop(None), health.stop, controller.close):
            serving.serve_metrics(args.host, args.metrics_port)
    stop = asyncio.Event()

    def shut_down(why: str) -> None:
        if stop.is_set():  # a second signal: the exit is under way, and bounded once
            return
        log.info("adapter service stopping (%s)", why)
        serving.exit_if_stuck(SHUTDOWN_GRACE_S + 10.0, "the adapter service")
        stop.set()

    serving.on_shutdown_signal(shut_down)
    while not stop.is_set():
        await health.set(await _reachable(controller, args.rpc_timeout))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    await health.set(False)
    await server.stop(grace=SHUTDOWN_GRACE_S)
    await health.stop()
    await controller.close()
    telemetry.shutdown(provider)
    return 0


async def _reachable(controller: Controller, bound: float) -> bool:
    """Both backends answered a check within 2 s (or the RPC bound, if shorter)."""
    try:
        checks = asyncio.gather(controller.store.check(), controller.registry.check())
        await asyncio.wait_for(checks, min(2.0, bound))
        return True
    except Exception as e:
        log.warning("storage or registry unreachable: %s", e)
        return False


async def start(
    args: argparse.Namespace, provider: Any = None
) -> tuple[grpc.aio.Server, serving.Health, Controller]:
    """Build, bind and start the service (also used in-process by the benchmark)."""
    try:
        base = base_model.load(args.base_model)
    except ValueError as e:  # an unknown alias, a missing or malformed checkpoint: a traceback before
        raise ConfigError(f"--base-model: {e}") from e
    bounds = deadlines.Bounds.from_args(args)
    store, registry = _backends(args, bounds)
    discover = (
        dns_discovery(args.pods_dns)
        if args.pods_dns
        else static_discovery([a.strip() for a in args.pods.split(",") if a.strip()])
    )
    if args.advertise_address:  # what pods dial for weights: refused before anything listens
        check_target(args.advertise_address, "--advertise-address")
    security = security_from_args(args)
    guard = security.guard(SERVICES, "adapter service")
    server = serving.make_server([*guard, *telemetry.server_interceptors(provider)])
    health = serving.Health(server, SERVICES)
    port = serving.bind(server, args.host, args.port, security.tls)
    await health.serve_plaintext(args.host, getattr(args, "health_port", 0))
    controller = Controller(
        registry,
        store,
        discover,
        _advertise(args, port),
        knobs=Knobs(
            spread_threshold=args.spread_threshold,
            max_replicas=args.max_replicas,
            slot_idle_seconds=args.slot_idle_seconds,
            host_idle_seconds=args.host_idle_seconds,
            disk_idle_seconds=args.disk_idle_seconds,
            hot_share=args.hot_share,
            popularity_half_life=args.popularity_half_life,
        ),
        poll_interval=args.poll_interval,
        lease_ttl=args.lease_ttl,
        bounds=bounds,
        staging_max_bytes=args.staging_max_bytes,
        interceptors=telemetry.client_interceptors(provider),
        tracer=telemetry.get_tracer("spindle.adapters", provider),
        security=security,
    )
    s3_import = store if isinstance(store, S3Store) else None
    admin = AdaptersService(controller, base, args.max_lora_rank, args.max_adapter_bytes, s3_import)
    adapters_pb2_grpc.add_AdaptersServicer_to_server(admin, server)
    adapters_pb2_grpc.add_PlacementServicer_to_server(PlacementService(controller), server)
    model_control_pb2_grpc.add_ModelControlServicer_to_server(WeightsService(controller), server)
    serving.enable_reflection(server, SERVICES)
    await server.start()
    await controller.start()
    await health.set(await _reachable(controller, bounds.rpc))
    log.info(
        "adapter service on %s (advertised %s), %s storage, %s registry, %d pods",
        serving.host_port(args.host, port), controller.advertise,
        type(store).__name__, type(registry).__name__, len(controller.pods),
    )  # fmt: skip
    return server, health, controller
