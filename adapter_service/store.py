"""Where acknowledged adapters live: S3 (the source of truth) or, embedded, a local directory.

Layout, under the prefix: `NAME/vNNNNNN/adapter_config.json`, `.../adapter_model.safetensors` and
`.../meta.json`. meta.json is written last and is the commit mark: a version without it does not
exist (a crash mid-upload leaves nothing that counts, and a failed upload deletes what it wrote).
`NAME/pinned` marks a pinned adapter. Everything the registry holds can be rebuilt from this.
The two stores differ only in their five primitives; the layout logic is shared.

Every S3 call is bounded (adapter_service/deadlines.py): a connect and a read timeout and a few
attempts. A write that times out may still land later (a frozen endpoint processes what it had
received when it wakes up), so a version being written is guarded by its registration lease in
the registry, and what a registration left behind without being acknowledged (files without a
meta.json, or a whole version the registry never indexed) is rolled back by the next
registration of the name (`roll_back`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapter_service.deadlines import Bounds, track

CONFIG, WEIGHTS, META = "adapter_config.json", "adapter_model.safetensors", "meta.json"
PROBE_SECONDS = 1.0  # an S3 health check's connect and read timeouts (the service waits 2 s for it)
_COMMIT_MARK = re.compile(r"[^/]+/v\d{6,}/" + re.escape(META))  # NAME/vNNNNNN/meta.json
READS_AT_ONCE = 32  # commit marks read concurrently by a listing of every adapter (a rebuild)


@dataclass
class Version:
    """One registered version of an adapter: what meta.json and the registry index hold."""

    name: str
    version: int
    sha256: str
    size_bytes: int
    rank: int
    target_modules: list[str]
    base_model: str
    created_at: float
    description: str = ""
    pinned: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Version:
        return cls(**json.loads(text))


class Abandoned(Exception):
    """The registration that started a write gave up on it: the commit mark is not written."""


@track
class Store:
    """The layout over five primitives a backend implements (blocking; called in a thread)."""

    label = "storage"  # what an RPC waiting on this store names when it runs out of time

    def _write(self, key: str, data: bytes | Path) -> None:
        raise NotImplementedError

    def _read(self, key: str) -> bytes:
        raise NotImplementedError

    def _keys(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def _delete(self, keys: list[str]) -> None:
        raise NotImplementedError

    def ping(self) -> None:
        raise NotImplementedError

    # --- the layout ------------------------------------------------------------------------------

    @staticmethod
    def _dir(name: str, version: int) -> str:
        return f"{name}/v{version:06d}/"

    def _put(self, meta: Version, config: bytes, weights: Path, abandoned: threading.Event) -> None:
        base = self._dir(meta.name, meta.version)
        written: list[str] = []
        try:
            for key, data in ((WEIGHTS, weights), (CONFIG, config), (META, meta.to_json().encode())):
                if abandoned.is_set():
                    raise Abandoned(f"{meta.name} v{meta.version}: the registration gave up before {key}")
                written.append(base + key)
                self._write(base + key, data)
        except BaseException:
            self._delete(written)  # nothing half-written survives a failed upload
            raise

    def _versions(self, name: str, latest: bool) -> list[Version]:
        """One listing, then a read of each commit mark wanted: with `latest`, only each name's
        highest (the zero-padded keys sort by version). Reading every version's cost a
        registration one read per version the name ever had: its 40th took 40 reads under its lease.
        Only keys of the layout are read: any other `.../meta.json` beside the adapters (a
        bucket's root shared with other tools) failed every rebuild of the index."""
        keys = self._keys(f"{name}/" if name else "")
        metas = sorted(k for k in keys if _COMMIT_MARK.fullmatch(k))
        if latest:
            metas = list({k.split("/")[0]: k for k in metas}.values())
        out = [Version.from_json(raw) for raw in self._read_all(metas)]
        pinned = {k.split("/")[0] for k in keys if k.endswith("/pinned")}
        for v in out:
            v.pinned = v.name in pinned
        return out

    def _read_all(self, keys: list[str]) -> list[bytes]:
        """Each key's bytes, up to READS_AT_ONCE at a time: a rebuild of the index reads one commit
        mark per adapter, and one at a time 10,000 S3 round trips outlasted every RPC's bound
        (2,000 on a local moto: 12 s)."""
        if len(keys) <= 1:
            return [self._read(k) for k in keys]
        with ThreadPoolExecutor(min(READS_AT_ONCE, len(keys)), thread_name_prefix="spindle-read") as pool:
            return list(pool.map(self._read, keys))

    def _roll_back(self, name: str, above: int) -> int:
        """Delete the files of `name`'s versions above `above` and of those without a commit mark;
        how many files."""
        keys = self._keys(f"{name}/")
        committed = {k.rsplit("/", 1)[0] for k in keys if k.endswith("/" + META)}
        gone = [
            k
            for k in keys
            if k.count("/") == 2
            and (k.rsplit("/", 1)[0] not in committed or int(k.split("/")[1].lstrip("v")) > above)
        ]
        self._delete(gone)
        return len(gone)

    def _remove(self, name: str) -> int:
        keys = self._keys(f"{name}/")
        self._delete(keys)
        return sum(k.endswith("/" + META) for k in keys)

    def _set_pinned(self, name: str, pinned: bool) -> None:
        if pinned:
            self._write(f"{name}/pinned", b"1")
        else:
            self._delete([f"{name}/pinned"])

    # --- async surface -------------------------------------------------------------------------

    async def put(
        self, meta: Version, config: bytes, weights: Path, abandoned: threading.Event | None = None
    ) -> None:
        """Write one version, its commit mark last; nothing of it remains if a write fails. Once
        `abandoned` is set the commit mark is not written (the caller answered already)."""
        await asyncio.to_thread(self._put, meta, config, weights, abandoned or threading.Event())

    async def read(self, name: str, version: int) -> tuple[bytes, bytes]:
        """(adapter_config.json, adapter_model.safetensors) of one version."""
        base = self._dir(name, version)
        return await asyncio.to_thread(lambda: (self._read(base + CONFIG), self._read(base + WEIGHTS)))

    async def versions(self, name: str = "", latest: bool = False) -> list[Version]:
        """Every committed version (of `name`, or of all adapters), oldest first per name; with
        `latest`, only each name's latest (what the service reads: one read a name)."""
        return await asyncio.to_thread(self._versions, name, latest)

    async def roll_back(self, name: str, above: int) -> int:
        return await asyncio.to_thread(self._roll_back, name, above)

    async def remove(self, name: str) -> int:
        return await asyncio.to_thread(self._remove, name)

    async def set_pinned(self, name: str, pinned: bool) -> None:
        await asyncio.to_thread(self._set_pinned, name, pinned)

    async def check(self) -> None:
        await asyncio.to_thread(self.ping)


class LocalStore(Store):
    """The embedded store: a directory, for `spindle up` and single-machine use."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.label = f"storage (directory {self.root})"
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / key

    def _write(self, key: str, data: bytes | Path) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        if isinstance(data, Path):
            shutil.copyfile(data, tmp)
        else:
            tmp.write_bytes(data)
        os.replace(tmp, path)

    def _read(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def _keys(self, prefix: str) -> list[str]:
        top = self._path(prefix) if prefix else self.root
        if not top.exists():
            return []
        return sorted(str(p.relative_to(self.root)) for p in top.rglob("*") if p.is_file())

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)
        for d in sorted({self._path(k).parent for k in keys}, key=lambda p: -len(p.parts)):
            while d != self.root and d.is_dir() and not any(d.iterdir()):
                d.rmdir()
                d = d.parent

    def ping(self) -> None:
        if not os.access(self.root, os.W_OK):
            raise OSError(f"storage directory {self.root} is not writable")


class S3Store(Store):
    """S3 (or any S3-compatible API) through boto3; large weights go up as multipart uploads.

    Credentials come from boto3's own chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a web
    identity token under IRSA, an instance profile), never from a flag.
    """

    label = "storage (S3)"

    def __init__(
        self,
        bucket: str,
        prefix: str = "adapters/",
        endpoint_url: str = "",
        region: str = "",
        bounds: Bounds | None = None,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if prefix and not prefix.endswith("/"):  # keys are PREFIX + NAME/...: a folder, or neighbours mix
            raise ValueError(f"--s3-prefix {prefix!r} must end with '/' (or be empty), as {prefix + '/'!r}")
        b = bounds or Bounds()
        self.bucket, self.prefix, self.attempts = bucket, prefix, max(b.s3_attempts, 1)

        def client(config: Config) -> Any:
            return boto3.client(
                "s3", endpoint_url=endpoint_url or None, region_name=region or None, config=config
            )

        self.s3 = client(
            Config(
                connect_timeout=b.s3_connect,
                read_timeout=b.s3_read,
                retries={"max_attempts": b.s3_attempts, "mode": "standard"},
                max_pool_connections=READS_AT_ONCE,  # botocore's 10 would queue a rebuild's reads
            )
        )
        self.transfer = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20)
        # The health check's own client: one attempt, PROBE_SECONDS to connect and to read. With the
        # data path's bounds a check into a silent endpoint (a frozen S3) ran 40 s in a worker thread
        # after the service's 2 s wait gave up on it; one a second filled the default executor
        # (starving every other backend call) and held the process past its stop (asyncio.run joins
        # those threads). Against a server that accepts and never answers (the unit test
        # `test_an_s3_health_check_into_a_silent_endpoint_ends_within_its_own_bounds`): 40.2 s and
        # six connections before, 1.0 s and one now.
        probe = min(PROBE_SECONDS, b.s3_connect), min(PROBE_SECONDS, b.s3_read)
        self.probe = client(
            Config(connect_timeout=probe[0], read_timeout=probe[1], retries={"total_max_attempts": 1})
        )

    def _write(self, key: str, data: bytes | Path) -> None:
        """Weights above the multipart threshold go through s3transfer (parts in parallel, each
        retried); anything smaller is one PutObject under the client's own bounds, without the
        transfer manager and thread pool s3transfer builds per call (seen to hang: boto3#4148)."""
        if isinstance(data, Path) and data.stat().st_size >= self.transfer.multipart_threshold:
            self.s3.upload_file(str(data), self.bucket, self.prefix + key, Config=self.transfer)
        elif isinstance(data, Path):
            with data.open("rb") as f:
                self.s3.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=f)
        else:
            self.s3.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def _read(self, key: str) -> bytes:
        return self.s3.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()

    def _keys(self, prefix: str) -> list[str]:
        out = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        ):
            out += [o["Key"][len(self.prefix) :] for o in page.get("Contents", [])]
        return sorted(out)

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes 1,000 keys at most
            self._delete_batch(keys[i : i + 1000])

    def _delete_batch(self, keys: list[str]) -> None:
        """DeleteObjects answers 200 and lists the keys it did not delete in `Errors` (boto3 raises
        nothing): ignored, a Delete answered done while storage kept the version, which came back
        at the next rebuild of the index. Those keys are retried; still there, it is an error."""
        delay = 0.1
        for attempt in range(1, self.attempts + 1):
            objects = [{"Key": self.prefix + k} for k in keys]
            reply = self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})
            errors = reply.get("Errors", [])
            if not errors:
                return
            keys = [e["Key"][len(self.prefix) :] for e in errors]
            if attempt < self.attempts:
                time.sleep(delay)
                delay *= 2
        first = errors[0]
        raise OSError(
            f"S3 did not delete {len(errors)} objects of s3://{self.bucket}/{self.prefix}: "
            f"{first['Key']}: {first.get('Code')} {first.get('Message', '')}"
        )

    def ping(self) -> None:
        self.probe.head_bucket(Bucket=self.bucket)

    def fetch_uri(self, uri: str, max_bytes: int) -> tuple[bytes, Path]:
        """An `s3://bucket/prefix/` with the two PEFT files: the config, and the weights in a temp file."""
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        if not uri.startswith("s3://") or not bucket:
            raise ValueError(f"expected s3://BUCKET/PREFIX/, got {uri!r}")
        key = key.rstrip("/") + "/" if key else ""
        head = self.s3.head_object(Bucket=bucket, Key=key + WEIGHTS)
        if head["ContentLength"] > max_bytes:
            size = head["ContentLength"]
            raise OverflowError(
                f"{uri}{WEIGHTS} is {size} bytes; the limit is {max_bytes} (--max-adapter-bytes): "
                f"{size - max_bytes} bytes too many"
            )
        config = self.s3.get_object(Bucket=bucket, Key=key + CONFIG)["Body"].read()
        fd, tmp = tempfile.mkstemp(prefix="spindle-import-")
        os.close(fd)
        self.s3.download_file(bucket, key + WEIGHTS, tmp, Config=self.transfer)
        return config, Path(tmp)
