"""The adapter service's Prometheus metrics (served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PLACEMENTS = Counter("spindle_adapter_placements", "Adapters placed on a pod, by weight source", ["source"])
PLACE_SECONDS = Histogram(
    "spindle_adapter_placement_seconds",
    "Time to place an adapter on a pod, by weight source",
    ["source"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CONTROL_OPS = Counter("spindle_adapter_control_ops", "ModelControl calls to pods, by result", ["op", "code"])
REFUSALS = Counter(
    "spindle_adapter_refusals", "Control ops a pod refused because the adapter or slot was in use", ["op"]
)
SPREADS = Counter("spindle_adapter_spreads", "Extra replicas placed for hot adapters")
HOT = Gauge("spindle_adapter_hot", "Adapters popular enough to belong on more than one pod (--hot-share)")
COOLED = Counter("spindle_adapter_cooled", "Idle adapters moved down a tier, by the tier left", ["tier"])
REBUILDS = Counter("spindle_adapter_registry_rebuilds", "Registry index rebuilt from storage")
REGISTERED = Gauge("spindle_adapter_registered", "Adapters registered (latest versions)")
ROTATED_LATE = Counter(
    "spindle_adapter_late_rotations", "Pods rotated by the policy leader after a registration missed them"
)
LEADER = Gauge("spindle_adapter_leader", "1 while this replica runs the policy loop (the leader lease)")
