"""ModelControl: the adapter operations the adapter service (and peer pods) drive on a model pod.

Served on the pod's control port only (see server.py). Each operation becomes an engine control
op, queued and executed on the engine thread at a quiescent point (between steps), so no forward
pass sees a slot change. Errors keep their meaning on the wire (status.py maps them): an unknown
adapter is NOT_FOUND, a slot in use or pinned is FAILED_PRECONDITION, a bad adapter is
INVALID_ARGUMENT, a checksum mismatch is DATA_LOSS.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from model_service.errors import UnavailableError
from model_service.lora.control import (
    ControlOp,
    ControlResult,
    EvictAdapter,
    LoadAdapter,
    PinAdapter,
    RegisterAdapter,
    SetActiveAdapter,
)
from model_service.lora.files import MAX_ADAPTER_BYTES, MAX_CONFIG_BYTES, UnsafeFileError, read_regular
from model_service.lora.pool import AdapterInfo
from model_service.pod.state import ModelPod
from model_service.pod.status import abort_for
from spindle.grpc_status import abort
from spindle.peft import pod_adapter_name_problem
from spindle.security import PLAINTEXT, Security
from spindle.v1 import model_control_pb2 as pb
from spindle.v1 import model_control_pb2_grpc

Code = grpc.StatusCode
_TIERS = {"gpu": pb.TIER_DEVICE, "cpu": pb.TIER_HOST, "disk": pb.TIER_DISK}
_CHUNK = 1 << 20
_MAX_CHUNK = 16 << 20


def _state(info: AdapterInfo | None, name: str, requests: int = 0) -> pb.AdapterState:
    """`requests`: the pod's Generate calls for the adapter so far (ModelPod.adapter_requests)."""
    if info is None:
        return pb.AdapterState(name=name, tier=pb.TIER_UNSPECIFIED, requests_total=requests)
    state = pb.AdapterState(
        name=info.name,
        tier=_TIERS[info.tier],
        refcount=info.refcount,
        pinned=info.pinned,
        rank=info.rank,
        sha256=info.sha256,
        adapter_id=info.adapter_id,
        requests_total=requests,
    )
    if info.slot is not None:
        state.slot = info.slot
    return state


class ModelControlService(model_control_pb2_grpc.ModelControlServicer):
    def __init__(
        self, pod: ModelPod, adapter_cache_dir: str | None = None, security: Security = PLAINTEXT
    ) -> None:
        self.pod, self.security = pod, security  # peers are dialled with the cluster's TLS and token
        # Without --adapter-cache-dir, a temporary directory of its own, removed at exit.
        own = None if adapter_cache_dir else tempfile.TemporaryDirectory(prefix="spindle-adapters-")
        self._own_cache = own  # kept: the directory goes when this object does
        self.cache_dir = Path(adapter_cache_dir or own.name)
        self.dirs: dict[str, Path] = {}  # adapters registered through this service -> their files

    # --- helpers ----------------------------------------------------------------------------------

    async def _ready(self, context: grpc.aio.ServicerContext) -> None:
        if self.pod.async_engine is None:
            await abort(context, Code.UNAVAILABLE, "model pod is still loading its model")

    async def _name(self, name: str, context: grpc.aio.ServicerContext) -> str:
        """`name`, or INVALID_ARGUMENT (`pod_adapter_name_problem` says which names)."""
        problem = pod_adapter_name_problem(name)
        if problem is not None:
            await abort(context, Code.INVALID_ARGUMENT, problem)
        return name

    async def _run(self, op: ControlOp, context: grpc.aio.ServicerContext) -> ControlResult:
        await self._ready(context)
        assert self.pod.async_engine is not None
        try:
            result = await asyncio.wrap_future(self.pod.async_engine.submit_control(op))
        except Exception as e:
            await abort_for(context, e)
        if isinstance(op, (RegisterAdapter, LoadAdapter)) and op.path is not None:
            replaced = self.dirs.get(op.name)
            self.dirs[op.name] = Path(op.path)  # registered: FetchAdapterWeights serves these files
            if replaced is not None and replaced != Path(op.path):
                self._remove_own(replaced)  # an older version's: nothing reads them any more
        return result

    def _forget_files(self, name: str) -> None:
        """Delete the files this pod wrote for `name`."""
        path = self.dirs.pop(name, None)
        if path is not None:
            self._remove_own(path)

    def _remove_own(self, path: Path) -> None:
        """Delete `path` if this pod wrote it (a peer or service transfer, in the cache directory);
        directories the operator registered are left alone. Each version's files used to stay in
        the cache directory when a new version replaced them, so a pod's disk filled with every
        update of its adapters."""
        if path.resolve().is_relative_to(self.cache_dir.resolve()):
            shutil.rmtree(path, ignore_errors=True)

    def _files(self, name: str, adapters: list[AdapterInfo]) -> Path | None:
        """The directory of a known adapter's files: registered here, or with the pod's --lora."""
        assert self.pod.engine is not None
        if not any(a.name == name for a in adapters):
            return None
        configured = self.pod.engine.config.lora_modules.get(name)
        return self.dirs.get(name) or (Path(configured) if configured else None)

    async def _info(self, name: str) -> AdapterInfo | None:
        adapters = await self.pod.adapters()
        return next((a for a in adapters if a.name == name), None)

    async def _described(self, name: str) -> pb.AdapterState:
        return _state(await self._info(name), name, self.pod.adapter_requests[name])

    # --- RPCs -------------------------------------------------------------------------------------

    async def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.SlotChange:
        name = await self._name(request.name, context)
        slot = request.slot if request.HasField("slot") else None
        path = request.path if request.HasField("path") else None
        result = await self._run(LoadAdapter(name, path, slot), context)
        return pb.SlotChange(
            slot=result.slot, evicted=result.evicted or "", adapter=await self._described(name)
        )

    async def PromoteFromDisk(
        self, request: pb.PromoteFromDiskRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdapterState:
        name = await self._name(request.name, context)
        if not request.path:
            await abort(
                context, Code.INVALID_ARGUMENT, "path is required: a directory with the PEFT adapter files"
            )
        await self._run(RegisterAdapter(name, request.path), context)
        return await self._described(name)

    async def PromoteFromPeer(
        self, request: pb.PromoteFromPeerRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdapterState:
        name = await self._name(request.name, context)
        path = await self._fetch_from_peer(name, request.peer, request.sha256, context)
        await self._run(RegisterAdapter(name, str(path)), context)
        return await self._described(name)

    async def Rotate(self, request: pb.RotateRequest, context: grpc.aio.ServicerContext) -> pb.AdapterState:
        """New weights under an existing name: new requests get them; running ones finish on the old."""
        name = await self._name(request.name, context)
        source = request.WhichOneof("source")
        if source is None:
            await abort(context, Code.INVALID_ARGUMENT, "give the new weights' `path` or `peer`")
        if source == "peer":
            path = await self._fetch_from_peer(name, request.peer, request.sha256, context)
        else:
            path = Path(request.path)
            if request.sha256:
                got = await self._sha256_of(path / "adapter_model.safetensors", context)
                if got != request.sha256:
                    await abort(
                        context, Code.DATA_LOSS, f"{path} has sha256 {got}, expected {request.sha256}"
                    )
        await self._run(RegisterAdapter(name, str(path)), context)
        return await self._described(name)

    async def _sha256_of(self, weights: Path, context: grpc.aio.ServicerContext) -> str:
        try:
            data = await asyncio.to_thread(read_regular, weights, self._max_bytes())
        except UnsafeFileError as e:  # a FIFO, a device, a directory, too large
            await abort(context, Code.INVALID_ARGUMENT, f"cannot read the new weights: {e}")
        except (OSError, ValueError) as e:  # missing, too long a name, a NUL byte
            await abort(context, Code.NOT_FOUND, f"cannot read the new weights {str(weights)[:200]!r}: {e}")
        return hashlib.sha256(data).hexdigest()

    def _max_bytes(self) -> int:
        engine = self.pod.engine
        return engine.config.max_adapter_bytes if engine is not None else MAX_ADAPTER_BYTES

    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext) -> pb.SlotChange:
        name = await self._name(request.name, context)
        result = await self._run(EvictAdapter(name, request.from_host, request.from_disk), context)
        if request.from_disk:
            self._forget_files(name)
        return pb.SlotChange(
            slot=-1 if result.slot is None else result.slot,
            evicted=name,
            adapter=await self._described(name),
        )

    async def Pin(self, request: pb.PinRequest, context: grpc.aio.ServicerContext) -> pb.AdapterState:
        name = await self._name(request.name, context)
        await self._run(PinAdapter(name, request.pinned), context)
        return await self._described(name)

    async def SetActive(
        self, request: pb.SetActiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdapterState:
        """Make a resident adapter the one `@active` requests get (running ones keep theirs)."""
        name = await self._name(request.name, context) if request.name else None
        await self._run(SetActiveAdapter(name), context)
        return await self._described(name) if name else pb.AdapterState()

    async def GetSlots(self, request: pb.GetSlotsRequest, context: grpc.aio.ServicerContext) -> pb.SlotReport:
        await self._ready(context)
        assert self.pod.engine is not None
        try:  # the last step boundary's, while a step runs long: the adapter service polls with a deadline
            now = await self.pod.load_stats.recent()
        except UnavailableError as e:  # the engine thread is stuck
            await abort_for(context, e)
        adapters = now.adapters
        slots = [
            pb.Slot(index=a.slot, adapter=a.name, refcount=a.refcount, pinned=a.pinned)
            for a in adapters
            if a.slot is not None
        ]
        if now.memory_used_bytes < now.memory_capacity_bytes:  # room without an eviction
            used = {s.index for s in slots}
            slots.append(pb.Slot(index=next(i for i in itertools.count() if i not in used)))
        active = next((a for a in adapters if a.active), None)
        return pb.SlotReport(
            slots=slots,
            adapters=[_state(a, a.name, self.pod.adapter_requests[a.name]) for a in adapters],
            active_adapter=active.name if active is not None else "",
        )

    async def FetchAdapterWeights(
        self, request: pb.FetchAdapterWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AdapterWeightsChunk]:
        name = await self._name(request.name, context)
        await self._ready(context)
        if not 0 <= request.chunk_bytes <= _MAX_CHUNK:
            await abort(context, Code.INVALID_ARGUMENT, f"chunk_bytes must be in [0, {_MAX_CHUNK}]")
        path = self._files(name, await self.pod.adapters())
        if path is None:
            await abort(context, Code.NOT_FOUND, f"adapter {name!r} has no files on this pod")
        try:  # the registered files may have been replaced or removed since
            config, data = await asyncio.to_thread(
                lambda: (
                    read_regular(path / "adapter_config.json", MAX_CONFIG_BYTES).decode(),
                    read_regular(path / "adapter_model.safetensors", self._max_bytes()),
                )
            )
        except (OSError, ValueError) as e:
            await abort(context, Code.FAILED_PRECONDITION, f"adapter {name!r}: cannot read its files: {e}")
        step = request.chunk_bytes or _CHUNK
        digest = hashlib.sha256(data).hexdigest()
        for offset in range(0, max(len(data), 1), step):
            first, last = offset == 0, offset + step >= len(data)
            yield pb.AdapterWeightsChunk(
                name=name,
                config_json=config if first else "",
                total_bytes=len(data) if first else 0,
                offset=offset,
                data=data[offset : offset + step],
                last=last,
                sha256=digest if last else "",
            )

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        timeout = request.timeout_seconds if request.HasField("timeout_seconds") else None
        if timeout is not None and not 0 <= timeout <= 3600:
            await abort(
                context, Code.INVALID_ARGUMENT, f"timeout_seconds must be in [0, 3600], got {timeout}"
            )
        finished, aborted = await self.pod.drain(timeout)
        if request.exit:
            self.pod.request_exit("Drain RPC asked to exit")
        return pb.DrainResponse(finished=finished, aborted=aborted)

    # --- peers ------------------------------------------------------------------------------------

    async def _fetch_from_peer(
        self, name: str, peer: str, expected_sha: str, context: grpc.aio.ServicerContext
    ) -> Path:
        """Stream the adapter from a peer pod, check its checksum, and keep it in the local cache dir."""
        if not peer:
            await abort(
                context, Code.INVALID_ARGUMENT, "peer (host:port of a model pod's control port) is required"
            )
        parts, config, reported = [], "", ""
        try:
            async with self.security.dial(peer, control=True) as channel:
                stub = model_control_pb2_grpc.ModelControlStub(channel)
                remaining = context.time_remaining()
                async for chunk in stub.FetchAdapterWeights(
                    pb.FetchAdapterWeightsRequest(name=name), timeout=remaining if remaining else 60
                ):
                    config = config or chunk.config_json
                    parts.append(chunk.data)
                    reported = chunk.sha256 or reported
        except grpc.aio.AioRpcError as e:
            code = Code.NOT_FOUND if e.code() == Code.NOT_FOUND else Code.UNAVAILABLE
            await abort(context, code, f"fetching adapter {name!r} from peer {peer}: {e.details()}")
        data = b"".join(parts)
        digest = hashlib.sha256(data).hexdigest()
        for want in (reported, expected_sha):
            if want and want != digest:
                await abort(
                    context, Code.DATA_LOSS, f"adapter {name!r} from {peer}: sha256 {digest}, expected {want}"
                )
        path = self.cache_dir / f"{name}-{digest[:16]}"

        def write() -> None:
            path.mkdir(parents=True, exist_ok=True)
            (path / "adapter_config.json").write_text(config)
            (path / "adapter_model.safetensors").write_bytes(data)

        await asyncio.to_thread(write)
        return path
