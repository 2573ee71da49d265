"""SmolLM2's perplexity on a fixed text with FP8 weights (`--quantization fp8`) against the
unquantized model (float32 on CPU, bfloat16 on CUDA): issue 33's quality target is within 2%.

The FP8 model is per-channel e4m3 weights with per-token e4m3 activations (W8A8), as online
quantization makes it; on CPU through the reference GEMM, on CUDA through `torch._scaled_mm`.
Prints one JSON line.

    .venv/bin/python bench/fp8_quality.py [--device cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP; see model_service/startup.py

import torch
import torch.nn.functional as F

from model_service.engine.batch_builder import StepItem
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
from model_service.engine.executor import own_module_tree
from model_service.models.fp8_linear import quantize_online
from model_service.models.loader import LoadedModel, load_model
from model_service.models.quantization import ONLINE
from model_service.startup import configure_process

# Written for this benchmark (no licence questions), plain expository English of the kind the
# model was trained on: ~300 tokens.
TEXT = """\
A lighthouse keeper's day began before sunrise. The first task was to climb the spiral stairs,
one hundred and twelve of them, and check that the lamp had burned steadily through the night.
The glass of the lens was wiped clean of soot and salt, because even a thin film could dim the
beam that ships relied on to find the harbour. After breakfast the keeper wrote in the logbook:
the direction and strength of the wind, the height of the waves, the ships that had passed, and
anything unusual that had been seen on the water. Supplies arrived by boat once a month, weather
permitting, and in winter the boat was often late. Fresh water was collected from the roof in a
large stone tank, and vegetables grew in a small walled garden that kept out the worst of the
spray. In the afternoon there was always something to repair: a hinge rusted by the sea air, a
cracked window pane, a leak in the oil store. When fog rolled in, the keeper sounded the horn
every thirty seconds until it lifted, sometimes for a whole night without rest. It was a lonely
life, but many keepers said they never felt alone, because every light on the horizon was a
ship whose crew was counting on them.
"""


def perplexity(loaded: LoadedModel, ids: list[int], device: str) -> float:
    """exp(mean negative log-likelihood) of `ids[1:]`, one prefill through our engine."""
    dtype = "float32" if device == "cpu" else "bfloat16"
    engine = Engine(EngineConfig(device=device, dtype=dtype, num_kv_blocks=64), loaded=loaded)
    state = engine.cache.allocate()
    assert engine.cache.reserve(state, len(ids))
    logits = engine.executor.execute(engine.builder.build([StepItem(state, ids, len(ids))]))
    engine.cache.free(state)
    target = torch.tensor(ids[1:], device=logits.device)
    return math.exp(F.cross_entropy(logits[:-1].float(), target).item())


def measure(device: str = "cpu", full: LoadedModel | None = None) -> dict[str, object]:
    """Both perplexities and their ratio, FP8 over unquantized; `full`: SmolLM2 already loaded
    (in the compute dtype, on `device`)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    t = time.perf_counter()
    full = full or load_model("smollm2", dtype, torch.device(device))
    # What load_model(quantization="fp8") does after loading, on a copy: one GGUF read, not two.
    module = own_module_tree(full.module)
    quantize_online(module)
    fp8 = dataclasses.replace(
        full, module=module, config=dataclasses.replace(full.config, quantization=ONLINE)
    )
    assert full.tokenizer is not None
    ids = full.tokenizer.encode(TEXT)
    base, quantized = perplexity(full, ids, device), perplexity(fp8, ids, device)
    return {
        "bench": "fp8_quality", "model": "smollm2-135m-instruct", "device": device, "dtype": str(dtype),
        "quantization": "fp8 online: per-channel e4m3 weights, per-token e4m3 activations",
        "tokens": len(ids), "ppl": round(base, 4), "ppl_fp8": round(quantized, 4),
        "ratio": round(quantized / base, 4), "seconds": round(time.perf_counter() - t, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu (float32 baseline) or cuda (bfloat16 baseline)")
    args = parser.parse_args()
    configure_process()
    print(json.dumps(measure(args.device)))


if __name__ == "__main__":
    main()
