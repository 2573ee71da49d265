"""A client of the adapter admin API, and `spindle adapters register | list | get | delete | pin`.

It talks to a gateway (the usual case: an API key with the admin scope) or straight to an
adapter service; both serve spindle.v1.Adapters. An upload is streamed in chunks with the sha256
of the weights, which the service checks before acknowledging anything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc

from spindle import flagtypes
from spindle.client import DEFAULT_GATEWAY, gateway_target, rpc_error_line
from spindle.service_token import HEADER as service_token_header
from spindle.service_token import ServiceToken
from spindle.tls import PLAINTEXT, TlsConfig, add_tls_args, sync_channel, tls_from_args
from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import adapters_pb2_grpc

CHUNK = 1 << 20
TIMEOUT = 60.0  # the CLI's default deadline of one call: more than the service's own bound (30 s)


def _chunks(header: apb.RegisterHeader, weights: Path) -> Iterator[apb.RegisterChunk]:
    yield apb.RegisterChunk(header=header)
    with open(weights, "rb") as f:
        while data := f.read(CHUNK):
            yield apb.RegisterChunk(data=data)


class AdaptersClient:
    def __init__(
        self,
        target: str = DEFAULT_GATEWAY,
        api_key: str | None = None,
        tls: TlsConfig = PLAINTEXT,
        service_token: bytes | None = None,
    ) -> None:
        """`service_token`: talking straight to an adapter service that requires it (no gateway)."""
        self.channel = sync_channel(target, tls)
        self.stub = adapters_pb2_grpc.AdaptersStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        if service_token:
            self.metadata += ((service_token_header, service_token.decode()),)

    def __enter__(self) -> AdaptersClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()

    def register(
        self, name: str, directory: str | Path, description: str = "", timeout: float = 300
    ) -> apb.Adapter:
        """Upload a PEFT directory (adapter_config.json + adapter_model.safetensors)."""
        d = Path(directory)
        weights = d / "adapter_model.safetensors"
        if not (d / "adapter_config.json").is_file() or not weights.is_file():
            found = (
                sorted(p.name for p in d.iterdir())
                if d.is_dir()
                else ("not a directory" if d.exists() else "no such file or directory")
            )
            raise FileNotFoundError(
                f"{d} needs adapter_config.json and adapter_model.safetensors (found: {found})"
            )
        digest = hashlib.sha256()
        with open(weights, "rb") as f:
            while data := f.read(CHUNK):
                digest.update(data)
        header = apb.RegisterHeader(
            name=name,
            config_json=(d / "adapter_config.json").read_bytes(),
            total_bytes=weights.stat().st_size,
            sha256=digest.hexdigest(),
            description=description,
        )
        return self.stub.Register(_chunks(header, weights), timeout=timeout, metadata=self.metadata)

    def list(self, page_size: int = 100, timeout: float = 30) -> list[apb.Adapter]:
        out, token = [], ""
        while True:
            page = self.stub.List(
                apb.ListAdaptersRequest(page_size=page_size, page_token=token),
                timeout=timeout,
                metadata=self.metadata,
            )
            out += page.adapters
            token = page.next_page_token
            if not token:
                return out

    def get(self, name: str, timeout: float = 30) -> apb.Adapter:
        return self.stub.Get(apb.GetAdapterRequest(name=name), timeout=timeout, metadata=self.metadata)

    def delete(self, name: str, timeout: float = 60) -> int:
        reply = self.stub.Delete(apb.DeleteAdapterRequest(name=name), timeout=timeout, metadata=self.metadata)
        return reply.versions_deleted

    def pin(self, name: str, pinned: bool = True, timeout: float = 30) -> apb.Adapter:
        return self.stub.Pin(
            apb.PinAdapterRequest(name=name, pinned=pinned), timeout=timeout, metadata=self.metadata
        )


def _summary(a: apb.Adapter) -> dict:
    tiers = {
        apb.PLACEMENT_TIER_DISK: "disk",
        apb.PLACEMENT_TIER_HOST: "host",
        apb.PLACEMENT_TIER_DEVICE: "device",
    }
    return {
        "name": a.name,
        "version": a.version,
        "sha256": a.sha256,
        "rank": a.rank,
        "size_bytes": a.size_bytes,
        "target_modules": list(a.target_modules),
        "pinned": a.pinned,
        "placements": [
            {"pod": p.pod, "tier": tiers.get(p.tier, "?"), "version": p.version} for p in a.placements
        ],
    }


def _connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway",
        type=gateway_target,
        default=DEFAULT_GATEWAY,
        help=f"HOST:PORT of a gateway or adapter service [{DEFAULT_GATEWAY}]",
    )
    parser.add_argument("--api-key", default=None, help="an API key with the admin scope")
    add_tls_args(parser, server=False)
    parser.add_argument(
        "--control-token-file", default="", help="the service token, to call an adapter service directly"
    )
    parser.add_argument(
        "--timeout",
        type=flagtypes.seconds,
        default=TIMEOUT,
        help=f"seconds to wait for the answer (register: the upload too) [{TIMEOUT:g}]",
    )


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The connection flags go before the action (`adapters --gateway G list`) or after it
    (`adapters list --gateway G`), as people type them: each action's parser has them too, with
    no default of its own, so it sets one only when it is given there."""
    _connection_args(parser)
    after = argparse.ArgumentParser(add_help=False)
    _connection_args(after)
    for action in after._actions:  # argparse has no public list of its actions (envflags.py)
        action.default = argparse.SUPPRESS
    sub = parser.add_subparsers(dest="action", required=True)

    def action(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, parents=[after])

    reg = action("register", "upload a PEFT adapter directory (a new version if NAME exists)")
    reg.add_argument("name")
    reg.add_argument("directory")
    reg.add_argument("--description", default="")
    action("list", "every registered adapter, with where it is placed")
    for name, help_ in (("get", "one adapter"), ("delete", "remove every version, everywhere")):
        action(name, help_).add_argument("name")
    pin = action("pin", "keep an adapter resident (--off to release)")
    pin.add_argument("name")
    pin.add_argument("--off", action="store_true")
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        token = ServiceToken(args.control_token_file).value() if args.control_token_file else None
        with AdaptersClient(args.gateway, args.api_key, tls_from_args(args), token) as client:
            t = args.timeout
            if args.action == "register":
                a = client.register(args.name, args.directory, args.description, timeout=t)
                print(f"registered {a.name} version {a.version} (rank {a.rank}, sha256 {a.sha256[:12]})")
            elif args.action == "list":
                for a in client.list(timeout=t):
                    print(json.dumps(_summary(a)))
            elif args.action == "get":
                print(json.dumps(_summary(client.get(args.name, timeout=t)), indent=2))
            elif args.action == "delete":
                n = client.delete(args.name, timeout=t)
                print(f"deleted {args.name}: {n} version{'s' if n != 1 else ''}")
            else:
                a = client.pin(args.name, not args.off, timeout=t)
                print(f"{a.name}: {'pinned' if a.pinned else 'not pinned'}")
        return 0
    except (FileNotFoundError, ValueError) as e:
        print(f"spindle adapters: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(rpc_error_line(f"adapters {args.action}", e, args.timeout), file=sys.stderr)
        return 1
