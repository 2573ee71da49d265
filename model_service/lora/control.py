"""Adapter control operations. They are queued and run only at a scheduler quiescent point
(between two engine steps), so no forward pass ever sees a slot change under it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model_service.lora.pool import LoraPool


@dataclass
class RegisterAdapter:
    """Add or replace an adapter in the disk tier (validated now)."""

    name: str
    path: str


@dataclass
class LoadAdapter:
    """Make an adapter resident: into `slot`, or the LRU idle slot (promotion). `path` registers it first."""

    name: str
    path: str | None = None
    slot: int | None = None


@dataclass
class EvictAdapter:
    """Clear its slot (refused while in use or pinned); `from_host` also drops the parsed copy;
    `from_disk` forgets the adapter here altogether (new requests for it get NOT_FOUND; running
    ones finish on its slot; refused only while pinned)."""

    name: str
    from_host: bool = False
    from_disk: bool = False


@dataclass
class PinAdapter:
    name: str
    pinned: bool = True


@dataclass
class SetActiveAdapter:
    """Rotate the adapter that `@active` requests get (None: none)."""

    name: str | None


ControlOp = RegisterAdapter | LoadAdapter | EvictAdapter | PinAdapter | SetActiveAdapter


@dataclass
class ControlResult:
    slot: int | None = None  # the slot used
    evicted: str | None = None  # the adapters evicted to make room, comma-separated, if any
    adapter_id: int = 0


def execute(op: ControlOp, pool: LoraPool) -> ControlResult:
    """Run one operation on the pool; raises AdapterError with a message when it cannot."""
    if isinstance(op, RegisterAdapter):
        return ControlResult(adapter_id=pool.register(op.name, Path(op.path)).adapter_id)
    if isinstance(op, LoadAdapter):
        if op.path is not None:
            pool.register(op.name, Path(op.path))
        slot, evicted = pool.load(op.name, op.slot)
        return ControlResult(slot, ", ".join(evicted) or None, pool.adapter_id_for(slot))
    if isinstance(op, EvictAdapter):
        if op.from_disk:
            return ControlResult(slot=pool.forget(op.name))
        slot = pool.evict(op.name) if pool.slot_of(op.name) is not None or not op.from_host else None
        if op.from_host:
            pool.drop_host_copy(op.name)
        return ControlResult(slot=slot)
    if isinstance(op, PinAdapter):
        return ControlResult(slot=pool.pin(op.name, op.pinned))
    if isinstance(op, SetActiveAdapter):
        slot = pool.set_active(op.name)
        return ControlResult(slot=slot if slot >= 0 else None, adapter_id=pool.adapter_id_for(-1))
    raise TypeError(f"unknown control operation {op!r}")
