"""Model pods for the tests, forked from a process that has imported what a pod imports.

`python -m spindle.cli serve` spends ~6 s of CPU importing (torch and the compiler modules that
llguidance pulls in, transformers, gRPC) before it reads its first flag, and the suite starts
~20 pods: two minutes of two shared cores. A zygote process (one per pytest worker, started at its
first pod) imports those modules once and forks a pod for each request. The pod then runs
`spindle.cli.main` with its flags, environment, working directory and log, as
`python -m spindle.cli` would, and ends the same way: its `SystemExit` unwinds to the interpreter,
which runs the atexit handlers and waits for non-daemon threads.

The zygote only imports: no thread of torch's runs, no gRPC channel or server exists, so the fork
is clean (as torch's own DataLoader workers are). The pod is the test process's child, as with
`subprocess.Popen`: the zygote's child forks it and exits at once, and the test process, a child
subreaper (prctl), adopts it. `Forked` waits for it and signals it as the tests do a Popen.
SPINDLE_TEST_FORK=0 starts every pod as a fresh interpreter instead (tests/service_helpers.py).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
ROOT = Path(__file__).resolve().parents[1]


class Forked:
    """A pod the test process adopted: what the tests use of `subprocess.Popen`."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None and self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        deadline = time.monotonic() + (timeout or 0)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_zygote: subprocess.Popen | None = None
_lock = threading.Lock()


def fork_pod(argv: list[str], env: dict[str, str], log: Path) -> Forked:
    """`spindle ARGV` (a `serve` command) forked from this worker's zygote, writing to `log`."""
    global _zygote
    with _lock:
        if _zygote is None or _zygote.poll() is not None:
            if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
            _zygote = subprocess.Popen(
                [sys.executable, "-m", "tests.zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=ROOT,
                env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
                text=True,
            )
            atexit.register(_zygote.stdin.close)  # at EOF it exits
        _zygote.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(ROOT), "log": str(log)}) + "\n")
        _zygote.stdin.flush()
        reply = _zygote.stdout.readline()
    if not reply:
        raise RuntimeError(f"the pod zygote exited ({_zygote.poll()}) before forking {argv}")
    return Forked(int(reply), [sys.executable, "-m", "spindle.cli", *argv])


def _pod(request: dict, replies) -> None:
    """In the forked pod: become `python -m spindle.cli ARGV`. Never returns: the SystemExit of
    `main`'s status unwinds through the zygote's frames (none catches it) to the interpreter."""
    import spindle.cli

    replies.close()
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, 1024)  # as Popen's close_fds
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [spindle.cli.__file__, *request["argv"]]
    raise SystemExit(spindle.cli.main(request["argv"]))


def _serve() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever an import prints goes to stderr, not into the replies
    import model_service.pod.server  # noqa: F401 (what `spindle serve` imports)
    import spindle.cli  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        intermediate = os.fork()
        if intermediate == 0:  # fork the pod, hand over its pid, exit: the pod is orphaned
            os.close(read)
            pid = os.fork()
            if pid == 0:
                os.close(write)
                _pod(request, replies)
            os.write(write, f"{pid}\n".encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as r:
            pid = r.readline()
        os.waitpid(intermediate, 0)  # once it is gone, the pod is the test process's child
        replies.write(pid)


if __name__ == "__main__":
    _serve()
