"""A cold adapter's cost: from a request to its first token, by where the weights come from.

Setup (printed in every line): loopback; a real Redis server and moto's S3 server; two model pods
on the embedded SmolLM2-135M (CPU unless a GPU is there), the adapter service (Redis + S3) and
the gateway, each its own process. Adapters are random PEFT LoRAs on all seven projections of
every layer, float32, at ranks 8 / 16 / 64. For each rank:

- staging: a freshly registered adapter (the service keeps a hot copy in Redis), first request
  through the gateway: placement (the pod pulls the weights from the service) + first token;
- storage: the same after the hot copy was dropped, so the service reads S3;
- peer: the adapter resident on one pod is placed on the other (the pod pulls it from its peer),
  then its first token there;
- resident: a request once the adapter is in a slot (the floor the others compare to);
- disk_to_slot / host_to_slot: ModelControl.LoadAdapter on a pod that holds the adapter only on
  its disk (parsed and copied in) or in host memory.

    .venv/bin/python bench/adapters.py [--ranks 8 16 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import redis  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from adapter_service import base_model  # noqa: E402
from adapter_service.client import AdaptersClient  # noqa: E402
from spindle.v1 import adapters_pb2 as apb  # noqa: E402
from spindle.v1 import (  # noqa: E402
    adapters_pb2_grpc,
    generation_pb2_grpc,
    model_control_pb2_grpc,
)
from spindle.v1 import model_control_pb2 as mc  # noqa: E402
from tests.adapter_helpers import aws_env, redis_server, s3_server  # noqa: E402
from tests.service_helpers import spawn, spawn_pod, token_request, wait_serving  # noqa: E402

MODEL = "smollm2-135m-instruct"


def write_adapter(path: Path, base: base_model.BaseModel, rank: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(base.num_layers):
        for module, (fan_in, fan_out) in base.projection_shapes().items():
            block = "self_attn" if module[0] in "qkvo" else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) * 0.01).astype(
                np.float32
            )
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.01).astype(
                np.float32
            )
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(tensors and base.projection_shapes()),
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def first_token_s(target: str, adapter: str) -> float:
    import grpc

    req = token_request([1, 2, 3, 4], 1, temperature=0.0)
    req.adapter = adapter
    with grpc.insecure_channel(target) as ch:
        t = time.perf_counter()
        for resp in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120):
            if resp.HasField("chunk") and resp.chunk.token_ids:
                return time.perf_counter() - t
    raise RuntimeError("no token")


def control(address: str):
    import grpc

    return grpc.insecure_channel(address)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    base = base_model.load(MODEL)
    with tempfile.TemporaryDirectory() as tmp_, contextlib.ExitStack() as stack:
        tmp = Path(tmp_)
        url = stack.enter_context(redis_server(tmp))
        s3 = stack.enter_context(s3_server(tmp, "bench"))
        pods = [
            spawn_pod(MODEL, tmp, f"pod{i}", "--max-loras", "4", "--max-cpu-loras", "64") for i in range(2)
        ]
        for p in pods:
            stack.callback(p.stop)
            wait_serving(p, timeout=600)
        service = spawn(
            "adapter-service",
            ["--pods", ",".join(p.control_address for p in pods), "--redis-url", url,
             "--s3-bucket", s3.bucket, "--s3-endpoint-url", s3.endpoint, "--base-model", MODEL,
             "--metrics-port", "0", "--poll-interval", "0.5"],
            tmp, "service", env=aws_env(),
        )  # fmt: skip
        stack.callback(service.stop)
        wait_serving(service)
        gateway = spawn(
            "gateway",
            ["--pods", ",".join(p.address for p in pods), "--allow-unauthenticated",
             "--health-interval", "0.2", "--adapter-service", service.address],
            tmp, "gateway",
        )  # fmt: skip
        stack.callback(gateway.stop)
        wait_serving(gateway)
        time.sleep(1.0)
        r = redis.Redis.from_url(url)
        import torch

        setup = {
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "model": MODEL,
            "pods": 2,
            "transport": "loopback",
            "dtype_on_disk": "float32",
            "targets": "q,k,v,o,gate,up,down x 30 layers",
        }
        admin = AdaptersClient(gateway.address)
        n = 0
        for rank in args.ranks:
            results: dict[str, list[float]] = {}
            size = 0
            for i in range(args.repeat):
                n += 1
                d = write_adapter(tmp / f"r{rank}-{i}", base, rank, seed=n)
                size = (d / "adapter_model.safetensors").stat().st_size
                staged = admin.register(f"r{rank}-staged-{i}", d).name
                results.setdefault("staging", []).append(first_token_s(gateway.address, staged))
                results.setdefault("resident", []).append(first_token_s(gateway.address, staged))
                n += 1
                cold = admin.register(
                    f"r{rank}-s3-{i}", write_adapter(tmp / f"r{rank}-s3-{i}", base, rank, seed=n)
                )
                for key in (
                    f"spindle:adapters:staged:{cold.sha256}",
                    f"spindle:adapters:staged:config:{cold.sha256}",
                ):
                    r.delete(key)
                results.setdefault("storage", []).append(first_token_s(gateway.address, cold.name))
                # peer: the pod that lacks it pulls it from the pod that has it
                with control(service.address) as ch:
                    placement = adapters_pb2_grpc.PlacementStub(ch)
                    holder = placement.Place(apb.PlaceRequest(adapter=staged), timeout=60).pods[0]
                    other = next(p for p in pods if p.control_address != holder)
                    t = time.perf_counter()
                    reply = placement.Place(
                        apb.PlaceRequest(adapter=staged, pods=[apb.PodHint(address=other.control_address)]),
                        timeout=60,
                    )
                    assert reply.source == "peer", reply
                    results.setdefault("peer", []).append(
                        time.perf_counter() - t + first_token_s(other.address, staged)
                    )
                # tiers on one pod: disk -> slot and host -> slot
                with control(other.control_address) as ch:
                    ctl = model_control_pb2_grpc.ModelControlStub(ch)
                    ctl.Evict(mc.EvictRequest(name=staged, from_host=True), timeout=30)
                    t = time.perf_counter()
                    ctl.LoadAdapter(mc.LoadAdapterRequest(name=staged), timeout=30)
                    results.setdefault("disk_to_slot", []).append(time.perf_counter() - t)
                    ctl.Evict(mc.EvictRequest(name=staged), timeout=30)
                    t = time.perf_counter()
                    ctl.LoadAdapter(mc.LoadAdapterRequest(name=staged), timeout=30)
                    results.setdefault("host_to_slot", []).append(time.perf_counter() - t)
            for source, times in results.items():
                what = "load_ms" if source.endswith("_to_slot") else "first_token_ms"
                line = {
                    "bench": "adapters",
                    "rank": rank,
                    "source": source,
                    what: round(statistics.median(times) * 1000, 1),
                    f"{what}_all": [round(x * 1000, 1) for x in times],
                    "adapter_bytes": size,
                    **setup,
                }
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
