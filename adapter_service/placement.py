"""Placement policy: which pod gets an adapter, where its weights come from, what cools down.

Pure functions over the pods' slot reports (and the gateway's load hints), so the policy can be
read and tested without a cluster. The controller (controller.py) carries the decisions out.

- replicas: an adapter drawing more than `hot_share` of recent requests (popularity.py) is
  hot and belongs on one pod per `hot_share` of traffic it draws, up to `max_replicas`: the
  head of the distribution is replicated, so its requests are spread and find it resident
  wherever they are routed; the tail (everything else) is on one pod. An adapter running on
  average `spread_threshold` or more requests per holding pod also gets one more pod (a burst
  is seen at the next poll, before its share has grown);
- target: among reachable pods that lack the adapter's latest version. A tail adapter goes to
  the pod that holds the fewest adapters (any tier; AIBrix's least-adapters policy), so each
  pod serves about as many distinct adapters and their device memory is pressed evenly; ties
  go to the better of room in slots (1.0 a free slot, 0.8 an idle slot that can be evicted, 0
  all slots busy) + the queue (fewest waiting) + the KV cache (1 - usage). A hot adapter's
  pod is chosen the other way round: the best room + queue + KV first (its requests are many,
  the pod's load matters more), the fewest adapters breaking ties;
- source: a reachable peer pod that holds the same sha256, else the service itself (staging
  copy, else storage);
- cool down: a device slot idle (refcount 0, not pinned) for `slot_idle_seconds` is evicted to
  host memory; a host copy idle for `host_idle_seconds` is dropped to the pod's disk; a disk
  copy idle for `disk_idle_seconds` is forgotten by the pod (only storage keeps it). The pods
  refuse to evict anything in use, so a race with a new request costs a refusal, never a request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spindle.v1 import adapters_pb2 as apb
from spindle.v1 import model_control_pb2 as mc

ROOM_FREE, ROOM_IDLE, ROOM_NONE = 1.0, 0.8, 0.0


@dataclass
class Knobs:
    spread_threshold: float = 8.0
    max_replicas: int = 4
    slot_idle_seconds: float = 300.0
    host_idle_seconds: float = 1800.0
    disk_idle_seconds: float = 86400.0
    hot_share: float = 0.02  # of recent requests: above it an adapter gets more pods
    popularity_half_life: float = 120.0  # seconds: how fast request counts are forgotten


@dataclass
class PodView:
    """One pod as its last GetSlots answered (`ok` False: the last poll failed)."""

    address: str
    ok: bool = False
    slots: list[mc.Slot] = field(default_factory=list)
    adapters: dict[str, mc.AdapterState] = field(default_factory=dict)
    placing: int = 0  # placements to it under way: adapters it will hold, not yet polled

    def load(self) -> int:
        """Adapters it holds (any tier) or is being given: what least-adapters balances. The
        placements under way count, or concurrent placements all chose the same emptiest pod."""
        return len(self.adapters) + self.placing

    def holds(self, name: str, sha256: str) -> bool:
        a = self.adapters.get(name)
        return a is not None and a.sha256 == sha256

    def room(self) -> float:
        if any(not s.adapter for s in self.slots):
            return ROOM_FREE
        if any(s.refcount == 0 and not s.pinned for s in self.slots):
            return ROOM_IDLE
        return ROOM_NONE


def match_hints(views: list[PodView], hints: list[apb.PodHint]) -> dict[str, apb.PodHint] | None:
    """Each pod's hint from the gateway, by control address; None when the gateway gave none.

    The gateway knows a pod by its serving address, the service by its control address: the
    same address when the pod serves both on one port, else the one pod on the hint's host (in
    Kubernetes: the pod IP)."""
    if not hints:
        return None
    known = {v.address for v in views}
    out = {h.address: h for h in hints if h.address in known}
    for h in hints:
        if h.address in known:
            continue
        host = h.address.rpartition(":")[0]
        same = [v.address for v in views if v.address.rpartition(":")[0] == host and v.address not in out]
        if len(same) == 1:
            out[same[0]] = h
    return out


def replicas_for(share: float, knobs: Knobs) -> int:
    """Pods an adapter drawing `share` of recent requests belongs on: one per `hot_share` of
    traffic (so a replica carries at most about `hot_share` of all requests), 1 to `max_replicas`."""
    return max(1, min(knobs.max_replicas, math.ceil(share / knobs.hot_share - 1e-9)))


def choose_target(
    views: list[PodView], name: str, sha256: str, hints: dict[str, apb.PodHint] | None, hot: bool = False
) -> PodView | None:
    """`hints`: from match_hints; only pods the gateway can route to are candidates. `hot`: the
    adapter is hot (replicas_for > 1), its pod is chosen by load first, else by fewest adapters."""
    candidates = [v for v in views if v.ok and not v.holds(name, sha256)]
    if hints is not None:
        candidates = [v for v in candidates if v.address in hints]
    if not candidates:
        return None
    hint = {v.address: (hints or {}).get(v.address) or apb.PodHint() for v in candidates}
    lo, hi = min(h.num_waiting for h in hint.values()), max(h.num_waiting for h in hint.values())

    def load(v: PodView) -> float:
        h = hint[v.address]
        queue = 1.0 if hi == lo else (hi - h.num_waiting) / (hi - lo)
        return v.room() + queue + (1.0 - h.kv_usage)

    def score(v: PodView) -> tuple[float, float, str]:
        fewest = -v.load()
        return (load(v), fewest, v.address) if hot else (fewest, load(v), v.address)

    return max(candidates, key=score)


def choose_peer(views: list[PodView], name: str, sha256: str, exclude: str) -> PodView | None:
    """A reachable pod holding exactly these weights, highest tier first (already parsed there)."""
    peers = [v for v in views if v.ok and v.address != exclude and v.holds(name, sha256)]
    return max(peers, key=lambda v: (v.adapters[name].tier, v.address), default=None)


@dataclass
class Evict:
    """Move `name` on `pod` one tier down: out of the `leaves` tier ("device", "host" or "disk")."""

    pod: str
    name: str
    leaves: str

    def request(self) -> mc.EvictRequest:
        return mc.EvictRequest(
            name=self.name, from_host=self.leaves in ("host", "disk"), from_disk=self.leaves == "disk"
        )


def to_spread(
    views: list[PodView], latest: dict[str, str], shares: dict[str, float], knobs: Knobs
) -> list[str]:
    """Registered adapters held by fewer pods than they belong on (`shares`: each adapter's
    share of recent requests), most popular first: each is placed on one more pod."""
    held: dict[str, list[PodView]] = {}  # one pass over the pods, not one per registered adapter
    for v in views:
        for name in v.adapters if v.ok else ():
            held.setdefault(name, []).append(v)
    out = []
    for name, views_of in held.items():
        sha = latest.get(name)
        holders = [v for v in views_of if sha is not None and v.holds(name, sha)]
        if not holders or len(holders) >= knobs.max_replicas:
            continue
        running = sum(v.adapters[name].refcount for v in holders)
        busy = running / len(holders) >= knobs.spread_threshold
        if busy or len(holders) < replicas_for(shares.get(name, 0.0), knobs):
            out.append(name)
    return sorted(out, key=lambda n: (-shares.get(n, 0.0), n))


def to_cool(
    views: list[PodView], idle_since: dict[tuple[str, str], float], pinned: set[str], now: float, knobs: Knobs
) -> list[Evict]:
    """Idle adapters to move one tier down. `idle_since` is updated: (pod, name) -> first idle poll."""
    seen, out = set(), []
    for v in views:
        if not v.ok:
            continue
        for name, a in v.adapters.items():
            key = (v.address, name)
            if a.refcount > 0 or a.pinned or name in pinned:
                idle_since.pop(key, None)
                continue
            seen.add(key)
            since = idle_since.setdefault(key, now)
            if a.tier == mc.TIER_DEVICE and now - since >= knobs.slot_idle_seconds:
                out.append(Evict(v.address, name, "device"))
                idle_since[key] = now  # the host tier's clock starts now
            elif a.tier == mc.TIER_HOST and now - since >= knobs.host_idle_seconds:
                out.append(Evict(v.address, name, "host"))
                idle_since[key] = now  # and the disk tier's
            elif a.tier == mc.TIER_DISK and now - since >= knobs.disk_idle_seconds:
                out.append(Evict(v.address, name, "disk"))
    for key in set(idle_since) - seen:
        del idle_since[key]
    return out
