"""Counting the steps that overlapped (engine/overlap.py), for the CPU and the GPU tests alike."""

from __future__ import annotations

import pytest

import model_service.engine.engine as engine_module


def count_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The engine's device-side sampling launches from here on: one entry (its rows) per step
    that went on without reading its tokens."""
    launches: list[int] = []
    original = engine_module.launch

    def counted(seqs, logits):
        launches.append(len(seqs))
        return original(seqs, logits)

    monkeypatch.setattr(engine_module, "launch", counted)
    return launches
