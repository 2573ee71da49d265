"""Choosing a model pod for a request, scored as the Gateway API Inference Extension scores.

A request for an adapter goes only to pods that report the adapter available (resident, in
host memory or on disk); among those, each gets the weighted sum of four scores in [0, 1]; the
best wins. Of pods with equal sums the one holding more of the prompt's prefix wins (a full
prefix hit on a pod one request busier ties with the idle pod: that tie used to be a coin flip,
half of a conversation's turns recomputing their prefix elsewhere); the rest are broken at
random, so equal pods share the load:

- adapter affinity, in this order (the Inference Extension's LoRA affinity scorer: 1.0 resident,
  0.8 room to load it, 0.6 requests queued there for it, 0 full; with its "room" split by
  where the load comes from and how much room there is):
    1.0         resident on the device: the request runs at once;
    0.8 .. 0.9  in host memory, and adapter memory is left: a load is a copy;
    0.7 .. 0.8  on the pod's disk only, and memory is left: a load parses the files first;
    (within each: + 0.1 x the fraction of adapter memory left, in bytes when the pod counts
    bytes, else in slots: the emptier pod evicts less for the load)
    0.6         no memory left, but requests waiting there already asked for it (being loaded);
    0.0         no memory left: the load waits for an idle adapter to evict.
  A pod that does not report tiers (older pods) has its non-resident adapters scored as disk.
  A base-model request scores 1.0 everywhere;
- prefix locality: the fraction of the prompt's leading blocks last sent to that pod;
- queue depth: the requests the pod reported in flight (waiting or running: least outstanding
  requests; counting only the waiting ones, a pod ten times slower than the rest, whose batch
  still had room, drew as much traffic as they did) plus the streams this gateway opened to
  it since that report (a burst between two load polls must not all land on one pod) less
  those it saw end (a fast pod's report is stale soonest), scaled between the least (1.0) and
  the most (0.0) loaded candidate;
- KV cache: 1 - the pod's KV usage.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

ADAPTER_RESIDENT, ADAPTER_HOST, ADAPTER_DISK, ADAPTER_WAITING, ADAPTER_FULL = 1.0, 0.8, 0.7, 0.6, 0.0
MEMORY_LEFT = 0.1  # what all of a pod's adapter memory left adds to a host or disk load


@dataclass
class Candidate:
    """What the router knows of one pod: its last load report, and the streams opened since."""

    address: str
    num_waiting: int = 0
    in_flight: int = 0  # requests the pod reported waiting or running (0 from a pod that does not say)
    unreported: int = 0  # streams this gateway opened to the pod since its last report, less those ended
    kv_usage: float = 0.0
    resident_adapters: set[str] = field(default_factory=set)  # on the device
    waiting_adapters: set[str] = field(default_factory=set)
    max_adapters: int = 0
    available_adapters: set[str] = field(default_factory=set)  # any tier
    host_adapters: set[str] = field(default_factory=set)
    memory_used_bytes: int = 0
    memory_capacity_bytes: int = 0  # 0: the pod counts slots (max_adapters), not bytes

    def memory_left(self) -> float:
        """The fraction of adapter memory free: bytes when the pod counts them, else slots."""
        if self.memory_capacity_bytes > 0:
            return max(0.0, 1.0 - self.memory_used_bytes / self.memory_capacity_bytes)
        if self.max_adapters > 0:  # `@active` names a resident adapter, it takes no slot
            used = sum(not a.startswith("@") for a in self.resident_adapters)
            return max(0.0, 1.0 - used / self.max_adapters)
        return 0.0


@dataclass
class Weights:
    adapter: float = 1.0
    prefix: float = 1.0
    queue: float = 1.0
    kv: float = 1.0


def adapter_score(pod: Candidate, adapter: str | None) -> float:
    """Adapter affinity, in the order of the module's docstring."""
    if adapter is None:
        return 1.0
    if adapter in pod.resident_adapters:
        return ADAPTER_RESIDENT
    left = pod.memory_left()
    if left > 0:
        tier = ADAPTER_HOST if adapter in pod.host_adapters else ADAPTER_DISK
        return tier + MEMORY_LEFT * left
    if adapter in pod.waiting_adapters:
        return ADAPTER_WAITING
    return ADAPTER_FULL


def queue_scores(pods: list[Candidate]) -> dict[str, float]:
    depth = {p.address: max(0, max(p.in_flight, p.num_waiting) + p.unreported) for p in pods}
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
