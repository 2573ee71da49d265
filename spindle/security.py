"""A service's security settings in one value: its TLS files and the cluster's service token.

Every server and client of Spindle takes the same flags (`add_security_args`), so the chart and
the quickstart configure all of them alike; docs/security.md is the operator's guide.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from spindle import flagtypes
from spindle import tls as tls_files
from spindle.errors import ConfigError
from spindle.service_token import RequireToken, ServiceToken, send_token
from spindle.tls_channel import aio_channel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Security:
    tls: tls_files.TlsConfig = tls_files.PLAINTEXT
    token: ServiceToken | None = None

    def guard(self, protected: Iterable[str], port_name: str) -> list[grpc.aio.ServerInterceptor]:
        """Server interceptors that demand the service token on `protected` services' RPCs."""
        if self.token is not None:
            return [RequireToken(self.token, protected, port_name)]
        if not self.tls.require_client_cert:
            log.warning(
                "the %s's control RPCs are open to anyone who reaches its port: give "
                "--control-token-file and/or --tls-require-client-cert (docs/security.md)",
                port_name,
            )
        return []

    def dial(
        self,
        target: str,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Iterable[Any] = (),
        control: bool = False,
    ) -> grpc.aio.Channel:
        """A channel to another service; `control` adds the service token to every call."""
        extra = send_token(self.token) if control and self.token is not None else []
        return aio_channel(target, self.tls, options, [*interceptors, *extra])


PLAINTEXT = Security()


def add_security_args(parser: argparse.ArgumentParser) -> None:
    tls_files.add_tls_args(parser)
    parser.add_argument_group("health").add_argument(
        "--health-port",
        type=flagtypes.port,
        default=0,
        help="also serve grpc.health.v1 alone, in plaintext, on this port: for Kubernetes' gRPC probes, "
        "which speak no TLS; 0 = off [0]",
    )
    parser.add_argument_group("service token").add_argument(
        "--control-token-file",
        default="",
        help="file (a mounted Secret) with the cluster's service token: control RPCs require it, and "
        "this service sends it on its own control calls (docs/security.md)",
    )


def security_from_args(args: argparse.Namespace) -> Security:
    path = getattr(args, "control_token_file", "")
    try:
        token = ServiceToken(path) if path else None
    except ValueError as e:  # a setting to fix: `spindle` prints it, exit 2
        raise ConfigError(str(e)) from e
    return Security(tls_files.tls_from_args(args), token)
