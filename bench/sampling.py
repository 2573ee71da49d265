"""The sampling kernels alone (CUDA): microseconds a call for the rejection kernel (top-k, min-p,
top-p) and the Gumbel-max kernel against the sorting path, on a 128k vocabulary at 1, 64 and 256
rows, for flat logits (a random model's: the rejection kernel's worst case, many rounds) and
peaked ones (Zipf-like, as trained models give). `--sweep` also times other tile widths and warp
counts, which is how the kernels' constants were chosen.

    PYTHONPATH=. python3 bench/sampling.py [--sweep]

One JSON line per (logits, rows, cut); a table last. Times are medians of `triton.testing.do_bench`
(L2 flushed between calls, so a pessimistic figure: in a decode step the logits were just
written); the sorting path's time includes its host work (pinned copies), as a step pays it.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import model_service.kernels.sampling as kernels
from model_service.engine.sampler import draw, filtered_probs
from model_service.engine.sampling_params import SamplingParams

VOCAB = 128_256
CUTS = [{}, {"top_k": 50}, {"min_p": 0.05}, {"top_p": 0.95}]
ROW_CONFIGS = [(1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16), (8192, 32)]
GUMBEL_CONFIGS = [(8192, 1024, 4), (8192, 2048, 8), (16384, 4096, 8), (4096, 1024, 4), (16384, 2048, 4)]


def logits_for(kind: str, rows: int, g: torch.Generator) -> torch.Tensor:
    if kind == "flat":
        return torch.randn(rows, VOCAB, device="cuda", generator=g) * 1.5
    rank = torch.arange(1, VOCAB + 1, device="cuda").float()
    zipf = -2.2 * torch.log(rank)[None, :] + torch.randn(rows, VOCAB, device="cuda", generator=g) * 0.3
    return zipf[:, torch.randperm(VOCAB, device="cuda", generator=g)]


def us(fn: object) -> float:
    return round(do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3, 1)


def kernel_times(
    logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, cut: dict, sweep: bool
) -> dict[str, float]:
    rows, vocab = logits.shape
    if not cut:  # temperature only: the Gumbel-max kernel
        times = {"kernel": us(lambda: kernels.gumbel_max(logits, temps, seeds))}
        for chunk, block, warps in GUMBEL_CONFIGS if sweep else []:
            n = -(-vocab // chunk)
            score = torch.empty(rows, n, device="cuda")
            col = torch.empty(rows, n, dtype=torch.int32, device="cuda")
            args = (logits, temps, seeds, score, col, vocab, logits.stride(0), n)

            def run(args=args, n=n, chunk=chunk, block=block, warps=warps) -> None:
                kernels._gumbel_max_kernel[(rows, n)](*args, CHUNK=chunk, BLOCK=block, num_warps=warps)

            times[f"chunk{chunk}/{block}x{warps}"] = us(run)
        return times
    cuts = (
        torch.full((rows,), cut.get("top_p", 1.0), device="cuda"),
        torch.full((rows,), cut.get("top_k", 0) or vocab, dtype=torch.int32, device="cuda"),
        torch.full((rows,), cut.get("min_p", 0.0), device="cuda"),
    )
    times = {"kernel": us(lambda: kernels.truncated_sample(logits, temps, cuts, seeds))}
    out = torch.empty(rows, dtype=torch.int32, device="cuda")
    for block, warps in ROW_CONFIGS if sweep else []:

        def run(block=block, warps=warps) -> None:
            kernels._truncated_kernel[(rows,)](
                logits, temps, *cuts, seeds, out, vocab, logits.stride(0),
                MAX_ROUNDS=kernels.MAX_ROUNDS, MARGIN=kernels.MARGIN, BLOCK=block, num_warps=warps,
            )  # fmt: skip

        times[f"{block}x{warps}"] = us(run)
    return times


def cases(logits: torch.Tensor, g: torch.Generator, sweep: bool) -> list[dict]:
    """Every cut of CUTS on these logits: the kernel's time (and the sweep's) and the sort's."""
    rows = len(logits)
    temps = torch.full((rows,), 0.8, device="cuda")
    seeds = torch.randint(1 << 62, (rows,), device="cuda", generator=g)
    out = []
    for cut in CUTS:
        params = [SamplingParams(temperature=0.8, **cut)] * rows
        sort = us(lambda params=params: draw(filtered_probs(logits, params), [None] * rows))
        out.append({"cut": cut, **kernel_times(logits, temps, seeds, cut, sweep), "sort": sort})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time other tile widths and warp counts too")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    setup = {"bench": "sampling", "vocab": VOCAB, "temperature": 0.8, "device": torch.cuda.get_device_name()}
    lines = []
    for kind in ("flat", "peaked"):
        for rows in (1, 64, 256):
            for line in cases(logits_for(kind, rows, g), g, args.sweep):
                line = {"logits": kind, "rows": rows, **line}
                print(json.dumps({**line, **setup}), flush=True)
                lines.append(line)
    print(f"\n{'logits':<7}{'rows':>5}  {'cut':<16}{'kernel us':>10}{'sort us':>9}")
    for line in lines:
        cut = json.dumps(line["cut"])
        print(f"{line['logits']:<7}{line['rows']:>5}  {cut:<16}{line['kernel']:>10}{line['sort']:>9}")


if __name__ == "__main__":
    main()
