"""For the adapter service tests: real backing servers (a Redis server and moto's S3 HTTP server,
each a process on a free loopback port, started once per session and stopped afterwards) and
the adapters they register."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.service_helpers import free_port


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} not listening on {port} after {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class S3:
    endpoint: str
    bucket: str
    proc: subprocess.Popen | None = None  # moto's server (tests/test_adapter_chaos.py freezes it)

    def client(self):
        import boto3

        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id="test", aws_secret_access_key="test",
        )  # fmt: skip

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for p in pages for o in p.get("Contents", []))


@contextlib.contextmanager
def redis_server(workdir: Path, port: int = 0) -> Iterator[str]:
    """A Redis server on loopback (`port`, or a free one), nothing persisted; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run scripts/setup.sh")
    port = port or free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        _wait_port(port, proc, "redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(proc)


@contextlib.contextmanager
def s3_server(workdir: Path, bucket: str = "spindle-test") -> Iterator[S3]:
    """moto's standalone S3 HTTP server on a free loopback port, with one bucket."""
    port = free_port()
    server = Path(sys.executable).with_name("moto_server")
    with open(workdir / "moto.log", "w") as out:
        proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out)
    try:
        _wait_port(port, proc, "moto_server")
        store = S3(f"http://127.0.0.1:{port}", bucket, proc)
        store.client().create_bucket(Bucket=store.bucket)
        yield store
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def s3(tmp_path_factory) -> Iterator[S3]:
    with s3_server(tmp_path_factory.mktemp("moto")) as store:
        yield store


def aws_env() -> dict[str, str]:
    """What the service processes need to reach moto (boto3's own variables, as in a cluster)."""
    return {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def lora_dirs(tiny_llama, tmp_path_factory):
    """Four PEFT adapters for the tiny Llama (a2 is a's next version), with different targets."""
    from transformers import AutoModelForCausalLM

    from tests.test_lora import make_adapter

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama.name, dtype="float32")
    root = tmp_path_factory.mktemp("svc_adapters")
    specs = {
        "a": dict(seed=11, r=4, target_modules=["q_proj", "v_proj"]),
        "a2": dict(seed=12, r=8, target_modules=["q_proj", "v_proj", "down_proj"]),
        "b": dict(seed=13, r=8, target_modules=["o_proj", "up_proj"]),
        "c": dict(seed=14, r=4, target_modules=["k_proj", "gate_proj"]),
    }
    return {n: make_adapter(hf, root / n, scale=0.3, lora_alpha=8, **kw) for n, kw in specs.items()}
