"""Faults on loopback for tests/test_faults.py: a Redis that can be killed and restarted on the same
port, and a TCP proxy that makes a server unreachable (and reachable again) without losing its data."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
from pathlib import Path

from tests.adapter_helpers import _stop, _wait_port
from tests.service_helpers import free_port


class RestartableRedis:
    """redis-server on a fixed loopback port; `kill` is SIGKILL (no clean shutdown), nothing persisted."""

    def __init__(self, workdir: Path) -> None:
        self.port, self.workdir = free_port(), workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is not installed: run scripts/setup.sh"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        _wait_port(self.port, self.proc, "redis-server")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _stop(self.proc)


class Outage:
    """A TCP proxy on its own port in front of `target_port`; `cut()` closes the listener and every
    open connection (the server becomes unreachable), `restore()` listens again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target, self.port = target_port, free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def restore(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener, conns, self._conns = self._listener, None, self._conns, []
        for s in [listener, *conns]:
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
