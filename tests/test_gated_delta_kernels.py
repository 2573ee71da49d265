"""The Gated DeltaNet step kernels (kernels/gated_delta.py) against the torch recurrence they
replace (models/gated_delta.py over the grid plan): decode rows, a verify run with checkpoints, a
fresh run, strided inputs as the layer passes them, and padding runs that must write no state;
and the gated RMSNorm against the module's torch code.

On CUDA (`pytest --noconftest -m gpu tests/test_gated_delta_kernels.py`); on the CPU under Triton's
interpreter too, when it is installed: `TRITON_INTERPRET=1 pytest tests/test_gated_delta_kernels.py`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from model_service.kernels.gated_delta import (
    StateRuns,
    gated_rms_norm_reference,
    gated_rms_norm_triton,
    triton,
)
from model_service.models.gated_delta import causal_conv, gated_delta_rule
from model_service.models.recurrent import RecurrentPlan, StaticRuns, starts_fresh
from model_service.models.step import StepBatch

interpreter = pytest.mark.skipif(
    triton is None or os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)
HK, HV, DK, DV, WIDTH, SLOTS = 2, 4, 16, 12, 4, 8  # DV = 12: a value block with masked columns
CONV = 2 * HK * DK + HV * DV


def _inputs(num_rows: int, seed: int, device: str) -> dict[str, torch.Tensor]:
    """What a layer hands the two kernels: in_proj_qkvz's rows (per key head: q, k, v, z) and the
    gates' inputs (some past softplus's linear threshold) as column views of one GEMM's rows, as
    `GatedDeltaNet.project` splits its packed projection, the conv weight, nonzero states."""
    gen = torch.Generator().manual_seed(seed)
    width = HK * (2 * DK + 2 * (HV // HK) * DV)
    packed = torch.randn(num_rows, width + 2 * HV, generator=gen)
    packed[:, width:] = packed[:, width:] * 3 + torch.tensor([0, 0, -2, 21] * HK)
    tensors = {
        "weight": torch.randn(CONV, 1, WIDTH, generator=gen) * 0.5,
        "a_log": torch.empty(HV).uniform_(0.02, 0.5, generator=gen).log(),
        "dt_bias": torch.randn(HV, generator=gen),
        "conv_state": torch.randn(SLOTS, WIDTH - 1, CONV, generator=gen),
        "ssm_state": torch.randn(SLOTS, HV, DK, DV, generator=gen) * 0.3,
    }
    qkvz, ba = packed.to(device).split([width, 2 * HV], dim=-1)
    return {"qkvz": qkvz.view(num_rows, HK, -1), "ba": ba} | {
        name: t.to(device) for name, t in tensors.items()
    }


def _layer(t: dict[str, torch.Tensor], plan: RecurrentPlan | StateRuns) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv over q, k, v read from in_proj_qkvz's rows, then the delta rule over q, k, v as
    views of the conv output (as GatedDeltaNet)."""
    n = t["qkvz"].shape[0]
    qkv = t["qkvz"].split([DK, DK, (HV // HK) * DV, (HV // HK) * DV], dim=-1)[:3]
    mixed = causal_conv(qkv, t["conv_state"], t["weight"], plan)
    padded = torch.zeros(n, CONV + 4, device=mixed.device)  # rows wider than the conv output
    padded[:, :CONV] = mixed
    q, k, v = padded[:, :CONV].split([HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.view(n, HK, DK), k.view(n, HK, DK), v.view(n, HV, DV)
    core = gated_delta_rule(q, k, v, t["ba"], t["a_log"], t["dt_bias"], t["ssm_state"], plan)
    return mixed, core


def _check(device: str) -> None:
    # Runs: a decode row, a verify run of 4 (checkpoints after its first three tokens), a fresh
    # run of 3 that leaves a snapshot after its second token, another decode row.
    query_start = np.array([0, 1, 5, 8, 9])
    snapshots = np.array([-1, 4, 5, 6, -1, -1, 7, -1, -1])
    slots = torch.tensor([0, 1, 2, 3], device=device)
    fresh = torch.tensor([False, False, True, False], device=device)
    ours, ref = _inputs(9, seed=1, device=device), _inputs(9, seed=1, device=device)
    runs = StateRuns(
        torch.as_tensor(query_start, device=device), slots, fresh, torch.as_tensor(snapshots, device=device)
    )
    plan = RecurrentPlan.from_runs(query_start, snapshots, slots, fresh)
    for got, want in zip(_layer(ours, runs), _layer(ref, plan), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name in ("conv_state", "ssm_state"):
        torch.testing.assert_close(ours[name], ref[name], rtol=1e-5, atol=1e-5)

    # Padding runs (slot -1): outputs as from zero state, and no state written anywhere.
    padded = _inputs(2, seed=2, device=device)
    before = {name: padded[name].clone() for name in ("conv_state", "ssm_state")}
    pad_runs = StateRuns(
        torch.arange(3, device=device),
        torch.tensor([3, -1], device=device),
        torch.tensor([True, False], device=device),
        torch.full((2,), -1, device=device),
    )
    pad_out = _layer(padded, pad_runs)
    for name, kept in before.items():  # slot 3 is the real run's
        torch.testing.assert_close(padded[name][:3], kept[:3], rtol=0, atol=0)
        torch.testing.assert_close(padded[name][4:], kept[4:], rtol=0, atol=0)
    fresh_row = _inputs(2, seed=2, device=device)
    fresh_runs = StateRuns(pad_runs.query_start, torch.tensor([3, 4], device=device),
                           torch.tensor([True, True], device=device), pad_runs.snapshots)  # fmt: skip
    for got, want in zip(pad_out, _layer(fresh_row, fresh_runs), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _check_static_runs(device: str) -> None:
    """A graph's view of `StaticRuns`, taken at capture and filled for a later step (verify runs
    of 3 and 2 tokens with checkpoints, a decode row, padded to 8 rows), runs the step as the
    step's own runs do on its rows, and its padding rows write no state."""
    query_start, snapshots = np.array([0, 3, 5, 6]), np.array([4, 5, -1, 6, -1, -1])
    slots = torch.tensor([0, 1, 2], device=device)
    seq_lens = torch.tensor([10, 7, 4], device=device)
    dummy = torch.zeros(6, dtype=torch.long, device=device)
    batch = StepBatch(
        input_ids=dummy, positions=dummy, slot_mapping=dummy, seq_lens=seq_lens, block_table=dummy[:3, None],
        query_start=torch.as_tensor(query_start, device=device), logits_rows=dummy, state_slots=slots,
        lora_slots=dummy, max_query_len=3, max_seq_len=10, host_lora_slots=np.full(6, -1),
        host_query_start=query_start, host_state_snapshots=snapshots,
    )  # fmt: skip
    static = StaticRuns(16, torch.device(device))
    captured = static.for_capture(8)
    static.prepare_for_replay(batch, 8)
    replayed = _inputs(8, seed=3, device=device)  # rows 6 and 7: the graph's padding rows
    eager = {name: t[:6].clone() if name in ("qkvz", "ba") else t.clone() for name, t in replayed.items()}
    fresh = torch.zeros(3, dtype=torch.bool, device=device)
    runs = StateRuns(batch.query_start, slots, fresh, torch.as_tensor(snapshots, device=device))
    for got, want in zip(_layer(replayed, captured), _layer(eager, runs), strict=True):
        torch.testing.assert_close(got[:6], want, rtol=0, atol=0)
    for name in ("conv_state", "ssm_state"):
        torch.testing.assert_close(replayed[name], eager[name], rtol=0, atol=0)


def _check_gated_norm(device: str, dtype: torch.dtype) -> None:
    """The gated RMSNorm over a gate that is a view of in_proj_qkvz's rows (no copy), as the layer
    passes it; float32 to rounding, bf16 to a unit in the last place."""
    gen = torch.Generator().manual_seed(4)
    group = HV // HK
    x = torch.randn(5, HV, DV, generator=gen).to(device, dtype)
    qkvz = torch.randn(5, HK, 2 * DK + 2 * group * DV, generator=gen).to(device, dtype)
    gate = qkvz[..., -group * DV :].unflatten(-1, (group, DV))
    weight = (1 + 0.3 * torch.randn(DV, generator=gen)).to(device, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    want = gated_rms_norm_reference(x, gate, weight, 1e-6)
    torch.testing.assert_close(gated_rms_norm_triton(x, gate, weight, 1e-6), want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton")
def test_step_kernels_match_the_torch_recurrence_on_cuda():
    torch.backends.cuda.matmul.allow_tf32 = False
    _check("cuda")
    _check_static_runs("cuda")
    _check_gated_norm("cuda", torch.float32)
    _check_gated_norm("cuda", torch.bfloat16)


@interpreter
def test_step_kernels_match_the_torch_recurrence_under_the_interpreter():
    _check("cpu")
    _check_static_runs("cpu")


@interpreter
def test_gated_norm_matches_the_torch_code_under_the_interpreter():
    """Apart from the step kernels' test: a failure there (or, in scripts/compile_kernels.sh, the
    step kernels' outputs left unwritten) must not keep this kernel from running."""
    _check_gated_norm("cpu", torch.float32)


def _runs_batch(query_start: list[int], snapshots: list[int], seq_lens: list[int]) -> StepBatch:
    """A CPU step of these runs (state slot i for run i), for `StaticRuns`."""
    dummy = torch.zeros(query_start[-1], dtype=torch.long)
    seqs = len(seq_lens)
    return StepBatch(
        input_ids=dummy, positions=dummy, slot_mapping=dummy, seq_lens=torch.tensor(seq_lens),
        block_table=dummy[:seqs, None], query_start=torch.tensor(query_start), logits_rows=dummy,
        state_slots=torch.arange(seqs), lora_slots=dummy, max_query_len=int(np.diff(query_start).max()),
        max_seq_len=max(seq_lens), host_lora_slots=np.full(len(dummy), -1),
        host_query_start=np.array(query_start), host_state_snapshots=np.array(snapshots),
    )  # fmt: skip


def test_static_runs_copy_no_offsets_for_a_decode_step_they_hold_and_match_a_fresh_fill(monkeypatch):
    """Replays of decode steps without checkpoints skip the host copy of offsets the buffers hold
    already (a hybrid model's batch-1 decode step paid a pinned copy and two device copies for
    them); every step's buffers still read as a fresh `StaticRuns` filled for that step alone."""
    import model_service.models.recurrent as recurrent

    copies = []

    def counted(host: np.ndarray, device: torch.device) -> torch.Tensor:
        copies.append(1)
        return torch.as_tensor(host)

    monkeypatch.setattr(recurrent, "to_device", counted)
    decode = _runs_batch([0, 1, 2], [-1, -1], [9, 5])
    steps = [
        (decode, 4, 1),  # the first decode step copies
        (decode, 4, 0),
        (_runs_batch([0, 1], [-1], [3]), 2, 0),  # a smaller decode step: the same runs' prefix
        (_runs_batch([0, 1, 2], [-1, 7], [9, 16]), 4, 1),  # a checkpoint
        (decode, 4, 1),  # the checkpoint's offsets are gone again
        (_runs_batch([0, 3, 4], [5, 6, -1, -1], [12, 5]), 8, 1),  # a verify run
        (decode, 8, 1),
        (decode, 16, 1),  # more rows than the buffers hold as decode runs
        (decode, 8, 0),
        (_runs_batch([0, 1, 2], [-1, -1], [1, 5]), 8, 0),  # a one-token prompt's first step: fresh
    ]
    static = StaticRuns(16, torch.device("cpu"))
    for batch, size, copied in steps:
        copies.clear()
        static.prepare_for_replay(batch, size)
        assert len(copies) == copied
        fresh = StaticRuns(16, torch.device("cpu"))
        fresh.prepare_for_replay(batch, size)
        for name in ("query_start", "snapshots", "slots"):
            n = size + (name == "query_start")
            assert torch.equal(getattr(static, name)[:n], getattr(fresh, name)[:n]), name
        assert torch.equal(static.fresh[: batch.num_seqs], fresh.fresh[: batch.num_seqs])
        assert torch.equal(static.fresh[: batch.num_seqs], starts_fresh(batch))
