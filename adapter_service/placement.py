"""Placement policy: which pod gets an adapter, where its weights come from, what cools down.

Pure functions over the pods' slot reports (and the gateway's load hints), so the policy can be
read and tested without a cluster. The controller (controller.py) carries the decisions out.

- target: among reachable pods that lack the adapter's latest version, the best by the gateway's
  signals: room in slots (1.0 a free slot, 0.8 an idle slot that can be evicted, 0 all slots
  busy), the queue (fewest waiting) and the KV cache (1 - usage);
- source: a reachable peer pod that holds the same sha256, else the service itself (staging
  copy, else storage);
- spread: an adapter running on average `spread_threshold` or more requests per holding pod is
  placed on one more pod, up to `max_replicas`;
- cool down: a device slot idle (refcount 0, not pinned) for `slot_idle_seconds` is evicted to
  host memory; a host copy idle for `host_idle_seconds` is dropped to the pod's disk; a disk
  copy idle for `disk_idle_seconds` is forgotten by the pod (only storage keeps it). The pods
  refuse to evict anything in use, so a race with a new request costs a refusal, never a request.
"""

from __future__ import annotations

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


@dataclass
class PodView:
    """One pod as its last GetSlots answered (`ok` False: the last poll failed)."""

    address: str
    ok: bool = False
    slots: list[mc.Slot] = field(default_factory=list)
    adapters: dict[str, mc.AdapterState] = field(default_factory=dict)

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


def choose_target(
    views: list[PodView], name: str, sha256: str, hints: dict[str, apb.PodHint] | None
) -> PodView | None:
    """`hints`: from match_hints; only pods the gateway can route to are candidates."""
    candidates = [v for v in views if v.ok and not v.holds(name, sha256)]
    if hints is not None:
        candidates = [v for v in candidates if v.address in hints]
    if not candidates:
        return None
    hint = {v.address: (hints or {}).get(v.address) or apb.PodHint() for v in candidates}
    lo, hi = min(h.num_waiting for h in hint.values()), max(h.num_waiting for h in hint.values())

    def score(v: PodView) -> tuple[float, str]:
        h = hint[v.address]
        queue = 1.0 if hi == lo else (hi - h.num_waiting) / (hi - lo)
        return v.room() + queue + (1.0 - h.kv_usage), v.address

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


def to_spread(views: list[PodView], latest: dict[str, str], knobs: Knobs) -> list[str]:
    """Registered adapters hot enough to be placed on one more pod."""
    out = []
    for name, sha in sorted(latest.items()):
        holders = [v for v in views if v.ok and v.holds(name, sha)]
        if not holders or len(holders) >= knobs.max_replicas:
            continue
        running = sum(v.adapters[name].refcount for v in holders)
        if running / len(holders) >= knobs.spread_threshold:
            out.append(name)
    return out


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
