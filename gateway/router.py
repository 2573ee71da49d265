"""Choosing a model pod for a request, scored as the Gateway API Inference Extension scores.

A request for an adapter goes only to pods that report the adapter available (resident, in
host memory or on disk); among those, each gets the weighted sum of four scores in [0, 1]; the
best wins. Of pods with equal sums the one holding more of the prompt's prefix wins (a full
prefix hit on a pod one request busier ties with the idle pod: that tie used to be a coin flip,
half of a conversation's turns recomputing their prefix elsewhere); the rest are broken at
random, so equal pods share the load:

- adapter affinity: 1.0 the adapter is resident in a slot, 0.8 a slot is free to load it,
  0.6 requests waiting there already asked for it (it is being loaded), 0 the pod is full.
  A base-model request scores 1.0 everywhere;
- prefix locality: the fraction of the prompt's leading blocks last sent to that pod;
- queue depth: the pod's reported waiting requests plus the streams this gateway opened to it
  since that report (a burst between two load polls must not all land on one pod), scaled
  between the least (1.0) and the most (0.0) loaded candidate;
- KV cache: 1 - the pod's KV usage.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

ADAPTER_RESIDENT, ADAPTER_ROOM, ADAPTER_WAITING, ADAPTER_FULL = 1.0, 0.8, 0.6, 0.0


@dataclass
class Candidate:
    """What the router knows of one pod: its last load report, and the streams opened since."""

    address: str
    num_waiting: int = 0
    unreported: int = 0  # streams this gateway opened to the pod since its last load report
    kv_usage: float = 0.0
    resident_adapters: set[str] = field(default_factory=set)
    waiting_adapters: set[str] = field(default_factory=set)
    max_adapters: int = 0
    available_adapters: set[str] = field(default_factory=set)


@dataclass
class Weights:
    adapter: float = 1.0
    prefix: float = 1.0
    queue: float = 1.0
    kv: float = 1.0


def adapter_score(pod: Candidate, adapter: str | None) -> float:
    if adapter is None:
        return 1.0
    if adapter in pod.resident_adapters:
        return ADAPTER_RESIDENT
    if len(pod.resident_adapters) < pod.max_adapters:
        return ADAPTER_ROOM
    if adapter in pod.waiting_adapters:
        return ADAPTER_WAITING
    return ADAPTER_FULL


def queue_scores(pods: list[Candidate]) -> dict[str, float]:
    depth = {p.address: p.num_waiting + p.unreported for p in pods}
    lo, hi = min(depth.values()), max(depth.values())
    return {a: 1.0 if hi == lo else (hi - d) / (hi - lo) for a, d in depth.items()}


def score(
    pods: list[Candidate], adapter: str | None, prefix: dict[str, float], weights: Weights | None = None
) -> dict[str, float]:
    w = weights or Weights()
    if not pods:
        return {}
    queue = queue_scores(pods)
    return {
        p.address: w.adapter * adapter_score(p, adapter)
        + w.prefix * prefix.get(p.address, 0.0)
        + w.queue * queue[p.address]
        + w.kv * (1.0 - p.kv_usage)
        for p in pods
    }


def choose(
    pods: list[Candidate],
    adapter: str | None,
    prefix: dict[str, float],
    weights: Weights | None = None,
    rng: random.Random | None = None,
) -> str | None:
    """The address of the best pod, or None when there is none (for an adapter: none that has it)."""
    if adapter is not None:
        pods = [p for p in pods if adapter in p.available_adapters]
    scores = score(pods, adapter, prefix, weights)
    if not scores:
        return None
    best = max(scores.values())
    top = [a for a, s in scores.items() if s >= best - 1e-9]
    most = max(prefix.get(a, 0.0) for a in top)
    return (rng or random).choice(sorted(a for a in top if prefix.get(a, 0.0) >= most))
