"""One gRPC call as raw HTTP/2 (the `h2` library), for header bytes a gRPC client refuses to send:
non-ASCII or invalid UTF-8 keys, CR / LF / NUL, upper-case names, malformed `grpc-timeout`."""

from __future__ import annotations

import socket
import time
import urllib.parse
from dataclasses import dataclass

import h2.config
import h2.connection
import h2.events


@dataclass
class RawOutcome:
    status: int | None  # grpc-status; None when the stream was reset or the connection closed
    message: str
    reset: str = ""  # why there is no status: RST_STREAM's error code, GOAWAY, or closed


def call(
    address: str, path: str, headers: list[tuple[bytes, bytes]], message: bytes, timeout: float = 10.0
) -> RawOutcome:
    """Send one request message on a fresh connection with exactly `headers` after the
    pseudo-headers; read until the stream ends."""
    config = h2.config.H2Configuration(
        client_side=True,
        header_encoding=None,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
        validate_inbound_headers=False,
    )
    conn = h2.connection.H2Connection(config=config)
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        base = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                (b":authority", address.encode()), (b"content-type", b"application/grpc"),
                (b"te", b"trailers")]  # fmt: skip
        conn.send_headers(stream, base + headers)
        conn.send_data(stream, b"\0" + len(message).to_bytes(4, "big") + message, end_stream=True)
        sock.sendall(conn.data_to_send())
        return _read(sock, conn, stream)


def _read(sock: socket.socket, conn: h2.connection.H2Connection, stream: int) -> RawOutcome:
    fields: dict[bytes, bytes] = {}
    while True:
        data = sock.recv(65536)
        if not data:
            return _outcome(fields, "connection closed")
        for event in conn.receive_data(data):
            if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                fields.update(dict(event.headers))
            elif isinstance(event, h2.events.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamReset) and event.stream_id == stream:
                return _outcome(fields, f"RST_STREAM {event.error_code!r}")
            elif isinstance(event, h2.events.ConnectionTerminated):
                return _outcome(fields, f"GOAWAY {event.error_code!r}")
            elif isinstance(event, h2.events.StreamEnded) and event.stream_id == stream:
                return _outcome(fields, "")
        sock.sendall(conn.data_to_send())


def _outcome(fields: dict[bytes, bytes], reset: str) -> RawOutcome:
    if b"grpc-status" not in fields:
        return RawOutcome(None, "", reset or "no grpc-status")
    message = urllib.parse.unquote(fields.get(b"grpc-message", b"").decode("ascii", "replace"))
    return RawOutcome(int(fields[b"grpc-status"]), message)


def pinging(address: str, every: float, seconds: float, path: str = "", message: bytes = b"") -> str:
    """PING the server every `every` s for `seconds` on a fresh connection, as a client's keepalive
    does (grpc-go, grpc-java, Envoy ping whatever the stream's traffic), during a call of `path`
    with `message` (none: an idle connection). Returns how it ended: "GOAWAY <code> <debug data>",
    "closed", "ended" (the call's stream, before `seconds`) or "open"."""
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=every / 4) as sock:
        conn.initiate_connection()
        if path:
            _start(conn, address, path, message)
        start = pinged = time.monotonic()
        buffered = b""
        while time.monotonic() - start < seconds:
            if time.monotonic() - pinged >= every:
                conn.ping(b"keepaliv")
                pinged = time.monotonic()
            sock.sendall(conn.data_to_send())
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                return "closed"
            frames, buffered = _frames(buffered + data)
            for frame in frames:  # one at a time: h2 raises on a frame after a GOAWAY, losing it
                for event in conn.receive_data(frame):
                    if isinstance(event, h2.events.ConnectionTerminated):
                        return f"GOAWAY {event.error_code!r} {event.additional_data!r}"
                    if isinstance(event, h2.events.StreamEnded):
                        return "ended"
    return "open"


def _frames(data: bytes) -> tuple[list[bytes], bytes]:
    """The whole HTTP/2 frames at the start of `data` (a 9-byte header, then its length), and the rest."""
    frames = []
    while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
        end = 9 + int.from_bytes(data[:3], "big")
        frames.append(data[:end])
        data = data[end:]
    return frames, data


def unresponsive(address: str, path: str, message: bytes, seconds: float) -> None:
    """A call of `path` with `message` from a client that hangs for `seconds` once the first
    response data came: its kernel keeps the connection (no FIN, TCP still acknowledged), but
    nothing reads it or answers a PING, as a stopped process or a peer cut off by a partition."""
    conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port))) as sock:
        conn.initiate_connection()
        _start(conn, address, path, message)
        sock.sendall(conn.data_to_send())
        events: list = []
        while not any(isinstance(e, h2.events.DataReceived) for e in events):
            events = conn.receive_data(sock.recv(65536))  # the server's first PING answered
            sock.sendall(conn.data_to_send())
        time.sleep(seconds)


def _start(conn: h2.connection.H2Connection, address: str, path: str, message: bytes) -> None:
    """A call of `path` with its one request `message`, half-closed (a unary or server-streaming call)."""
    stream = conn.get_next_available_stream_id()
    conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", path),
                               (":authority", address), ("content-type", "application/grpc"),
                               ("te", "trailers")])  # fmt: skip
    conn.send_data(stream, b"\0" + len(message).to_bytes(4, "big") + message, end_stream=True)
