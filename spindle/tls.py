"""TLS and mutual TLS for every Spindle server and channel, from PEM files (a mounted Secret).

One identity per service: `--tls-cert-file`/`--tls-key-file` is the certificate it serves and,
towards servers that require one, the client certificate it shows; `--tls-ca-file` is the CA
bundle it trusts, for the servers it calls and (with `--tls-require-client-cert`) for its clients.

Rotation: a server re-reads the files on the next TLS handshake after they change (gRPC asks a
certificate fetcher before each handshake), so cert-manager renewing a Secret needs no restart;
a half-written pair (new certificate, old key) is ignored until both match. A service's client
channel is made again with the new files (spindle/tls_channel.py); the synchronous channel of
the CLI clients reads them once, at start.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from spindle.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    require_client_cert: bool = False
    server_name: str = ""  # the name expected in the certificates of the servers this one calls
    system_roots: bool = False  # a client of a public endpoint: TLS with the system's CA bundle

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert_file)

    @property
    def dials_tls(self) -> bool:
        return bool(self.ca_file) or self.system_roots

    def check(self) -> TlsConfig:
        """Refuse contradictory settings at start-up, with the flag to fix."""
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("give both --tls-cert-file and --tls-key-file, or neither")
        if self.require_client_cert and not (self.cert_file and self.ca_file):
            raise ValueError(
                "--tls-require-client-cert needs --tls-cert-file/--tls-key-file (served) and "
                "--tls-ca-file (the CA of accepted client certificates)"
            )
        for path in (self.cert_file, self.key_file, self.ca_file):
            if path and not os.path.isfile(path):
                raise ValueError(f"TLS file {path!r} does not exist")
        # Their contents too: a file that is no PEM, or a key of another certificate, was an
        # SSLError / ValueError traceback from the first server or channel that loaded them.
        check_pair(self)
        if self.ca_file:
            try:
                ssl.create_default_context(cafile=self.ca_file)
            except ssl.SSLError as e:
                raise ValueError(f"--tls-ca-file {self.ca_file} holds no usable CA certificate: {e}") from e
        return self


PLAINTEXT = TlsConfig()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def paths(tls: TlsConfig) -> tuple[str, ...]:
    return tuple(p for p in (tls.cert_file, tls.key_file, tls.ca_file) if p)


def check_pair(tls: TlsConfig) -> None:
    """Raise ValueError unless the key belongs to the certificate (a rotation may be half-way)."""
    if not tls.cert_file:
        return
    try:  # the stdlib checks the pair; gRPC would only fail handshakes later
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as e:
        raise ValueError(
            f"--tls-key-file {tls.key_file} is not the key of --tls-cert-file {tls.cert_file} (or one "
            f"of them is no PEM file): {e}"
        ) from e


def stamp(paths: tuple[str, ...]) -> tuple:
    """Changes whenever one of the files is replaced (a Secret update swaps a symlink) or rewritten."""
    out = []
    for p in paths:
        st = os.stat(p)
        out.append((p, st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


class _ServerCertificates:
    """The certificate fetcher gRPC calls before each handshake: new files, or None for unchanged."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        self.paths = paths(tls)
        self.stamp = stamp(self.paths)
        self.initial = self._load()

    def _load(self) -> Any:
        check_pair(self.tls)
        ca = _read(self.tls.ca_file) if self.tls.ca_file else None
        return grpc.ssl_server_certificate_configuration(
            [(_read(self.tls.key_file), _read(self.tls.cert_file))], root_certificates=ca
        )

    def __call__(self) -> Any:
        try:
            now = stamp(self.paths)
            if now == self.stamp:
                return None
            config = self._load()
        except (OSError, ValueError) as e:  # mid-rotation: keep serving the previous files
            log.warning("TLS files changed but are not usable yet (%s); keeping the previous ones", e)
            return None
        self.stamp = now
        log.info("TLS certificate reloaded from %s", self.tls.cert_file)
        return config


class ServerSslContext:
    """The TLS of a server that is not gRPC (the OpenAI HTTP port), following its files as the
    gRPC servers' do: `listening` is the context to serve with; before each handshake (Python's
    `sni_callback` runs for every ClientHello, with or without a server name) the files are
    checked, and a changed, matching pair is served from then on."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        self.paths = paths(tls)
        self.stamp = stamp(self.paths)
        self.current = self._load()
        self.listening = self._load()
        self.listening.sni_callback = self._choose

    def _load(self) -> ssl.SSLContext:
        check_pair(self.tls)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls.cert_file, self.tls.key_file)
        if self.tls.require_client_cert:
            context.load_verify_locations(self.tls.ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def _choose(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        try:
            now = stamp(self.paths)
            if now != self.stamp:
                self.current, self.stamp = self._load(), now
                log.info("TLS certificate reloaded from %s", self.tls.cert_file)
        except (OSError, ValueError, ssl.SSLError) as e:  # mid-rotation: keep serving the previous files
            log.warning("TLS files changed but are not usable yet (%s); keeping the previous ones", e)
        connection.context = self.current


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    certificates = _ServerCertificates(tls)
    return grpc.dynamic_ssl_server_credentials(
        certificates.initial, certificates, require_client_authentication=tls.require_client_cert
    )


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Read now: the files as they are when the channel is made."""
    root = _read(tls.ca_file) if tls.ca_file else None
    if tls.cert_file:
        return grpc.ssl_channel_credentials(root, _read(tls.key_file), _read(tls.cert_file))
    return grpc.ssl_channel_credentials(root)


def channel_options(tls: TlsConfig) -> list[tuple[str, Any]]:
    return [("grpc.ssl_target_name_override", tls.server_name)] if tls.dials_tls and tls.server_name else []


def sync_channel(target: str, tls: TlsConfig, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    opts = [*options, *channel_options(tls)]
    if tls.dials_tls:
        return grpc.secure_channel(target, channel_credentials(tls), options=opts)
    return grpc.insecure_channel(target, options=opts)


def add_tls_args(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    g = parser.add_argument_group("TLS (see docs/security.md)")
    who = "served, and shown to servers that require a client certificate" if server else "client certificate"
    g.add_argument("--tls-cert-file", default="", help=f"PEM certificate chain: {who}")
    g.add_argument("--tls-key-file", default="", help="PEM private key of --tls-cert-file")
    g.add_argument(
        "--tls-ca-file",
        default="",
        help="PEM CA bundle trusted for the servers this one calls (turns TLS on for them)"
        + ("; with --tls-require-client-cert, also for client certificates" if server else ""),
    )
    g.add_argument(
        "--tls-server-name",
        default="",
        help="name expected in the called servers' certificates (pods are dialled by IP) [the target's host]",
    )
    if server:
        g.add_argument(
            "--tls-require-client-cert",
            action="store_true",
            help="mutual TLS: refuse clients without a certificate signed by --tls-ca-file",
        )
    else:
        g.add_argument("--tls", action="store_true", help="TLS with the system's CA bundle")


def tls_from_args(args: argparse.Namespace) -> TlsConfig:
    try:
        return TlsConfig(
            cert_file=getattr(args, "tls_cert_file", ""),
            key_file=getattr(args, "tls_key_file", ""),
            ca_file=getattr(args, "tls_ca_file", ""),
            require_client_cert=getattr(args, "tls_require_client_cert", False),
            server_name=getattr(args, "tls_server_name", ""),
            system_roots=getattr(args, "tls", False),
        ).check()
    except ValueError as e:  # a setting to fix, as a usage error is: `spindle` prints it, exit 2
        raise ConfigError(str(e)) from e
