"""Adapters from disk into their host form: buffers lent and taken back, the chunked digest behind
`adapter_id`, the sha256 a read takes from its registration, and what the conversion writes."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from bench.adapter_loads import NoSlots
from bench.lora import write_adapter
from model_service.lora import adapter as adapter_module
from model_service.lora import reading
from model_service.lora.adapter import AdapterError, HostForm, load_peft_adapter
from model_service.lora.buffers import HostBuffers
from model_service.lora.pool import LoraPool
from model_service.models.config import ModelConfig

CFG = ModelConfig(
    family="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=64,
)  # fmt: skip
WEIGHTS = "adapter_model.safetensors"
CPU = torch.device("cpu")


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    """Rank 6, so each B has padding columns (rows `aligned_up(6)` = 8 apart) the kernels read."""
    return write_adapter(tmp_path / "a", CFG, rank=6, seed=1, targets=["q_proj", "down_proj"])


class _Fence:
    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed


def test_a_buffer_is_lent_again_only_when_no_tensor_over_it_is_left():
    buffers = HostBuffers(CPU)
    first = buffers.take(1000, torch.bfloat16)
    block = first.data_ptr()
    view = first[10:20].view(2, 5)[1:]  # a view of a view holds the block too
    del first
    other = buffers.take(1000, torch.bfloat16)
    assert other.data_ptr() != block
    del view
    again = buffers.take(500, torch.float32)  # the same size class (2,048 bytes), another dtype
    assert again.data_ptr() == block and again.numel() == 500 and buffers.allocated == 2


def test_a_page_locked_block_waits_for_its_fence_and_spares_are_bounded(monkeypatch):
    """The GPU's path on this CPU: blocks "page-locked" (the allocation is faked), so a block that
    comes back is lent again only once the device copies queued before it have finished."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs))
    fences: list[_Fence] = []

    def fence() -> _Fence:
        fences.append(_Fence())
        return fences[-1]

    buffers = HostBuffers(torch.device("cuda"), fence=fence)
    t = buffers.take(100, torch.float32)
    block = t.data_ptr()
    del t  # a copy to the device queued before may still read it
    assert buffers.take(100, torch.float32).data_ptr() != block
    fences[0].passed = True
    assert buffers.take(100, torch.float32).data_ptr() == block
    buffers = HostBuffers(CPU, spare=1)
    held = [buffers.take(100, torch.float32) for _ in range(3)]
    del held  # three come back, one is kept
    again = [buffers.take(100, torch.float32) for _ in range(3)]
    assert len({t.data_ptr() for t in again}) == 3 and buffers.allocated == 5


def test_the_id_follows_the_bytes_not_the_path_or_the_threads(adapter_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "HASH_CHUNK", 1024)  # several chunks, read by several threads
    a = load_peft_adapter("a", adapter_dir, CFG, 64)
    data = (adapter_dir / WEIGHTS).read_bytes()
    chunks = b"".join(hashlib.sha256(data[i : i + 1024]).digest() for i in range(0, len(data), 1024))
    head = b"spindle-chunked-sha256\0" + len(data).to_bytes(8, "little")
    assert a.chunked == hashlib.sha256(head + chunks).digest() and len(data) > 4 * 1024
    assert a.sha256 == hashlib.sha256(data).hexdigest()  # what peers and the adapter service compare
    copy = shutil.copytree(adapter_dir, tmp_path / "copy")
    monkeypatch.setattr(reading, "_HASHERS", concurrent.futures.ThreadPoolExecutor(1))
    b = load_peft_adapter("b", copy, CFG, 64)
    assert (b.adapter_id, b.chunked, b.sha256) == (a.adapter_id, a.chunked, a.sha256)
    flipped = bytearray(data)
    flipped[-1] ^= 1  # one bit of the last weight
    (copy / WEIGHTS).write_bytes(flipped)
    c = load_peft_adapter("c", copy, CFG, 64)
    assert c.adapter_id != a.adapter_id and c.chunked != a.chunked and c.sha256 != a.sha256


def test_a_read_takes_the_known_sha256_only_for_the_same_bytes(adapter_dir):
    a = load_peft_adapter("a", adapter_dir, CFG, 64)
    assert (
        load_peft_adapter("a", adapter_dir, CFG, 64, known=(a.chunked, "registered")).sha256 == "registered"
    )
    assert load_peft_adapter("a", adapter_dir, CFG, 64, known=(bytes(32), "registered")).sha256 == a.sha256


def test_reads_for_admission_reuse_host_memory_and_hash_no_file_whole(adapter_dir, monkeypatch):
    """Registration hashes the file; a read for admission (a worker thread) reuses the buffer the
    last host copy left and takes the registered sha256, without a plain hash of its own."""
    form = HostForm(torch.bfloat16, HostBuffers(CPU))
    readers = concurrent.futures.ThreadPoolExecutor(1)
    pool = LoraPool(CFG, 1, 1, 64, NoSlots(), (1 << 20, 2), host_form=form, readers=readers)
    registered = pool.register("a", adapter_dir)
    assert registered.sha256 == hashlib.sha256((adapter_dir / WEIGHTS).read_bytes()).hexdigest()

    def no_plain_hash(data: torch.Tensor) -> concurrent.futures.Future[str]:
        raise AssertionError("a read for admission hashed the whole file")

    monkeypatch.setattr(adapter_module, "sha256_of", no_plain_hash)
    for _ in range(3):
        pool.drop_host_copy("a")
        while not pool.host_ready("a"):
            concurrent.futures.wait(pool.pending_reads())
        held = pool.host["a"]
        assert (held.adapter_id, held.sha256) == (registered.adapter_id, registered.sha256)
        del held
    assert form.buffers.allocated == 2  # the registered copy's (still held here) and one reused


def _with_header(tensors: dict[str, torch.Tensor], pad: int) -> bytes:
    """`tensors` as safetensors whose data starts `pad` bytes past an 8-byte boundary (writers
    other than safetensors' own need not align it)."""
    data = save(tensors)
    (n,) = struct.unpack("<Q", data[:8])
    text = json.dumps(json.loads(data[8 : 8 + n]), separators=(",", ":")).encode()
    text += b" " * ((pad - 8 - len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


@pytest.mark.parametrize(("file_dtype", "pad"), [(torch.float32, 0), (torch.bfloat16, 3), (torch.float16, 1)])
def test_each_tensor_is_converted_once_into_place_and_padding_reads_zero(adapter_dir, file_dtype, pad):
    """From a float32, bf16 or fp16 file, aligned or not: the host form holds the file's weights in
    its own dtype, and B's padding columns are zero even in a reused buffer that held NaNs."""
    ref = {k: v.to(file_dtype) for k, v in load_file(str(adapter_dir / WEIGHTS)).items()}
    (adapter_dir / WEIGHTS).write_bytes(_with_header(ref, pad))
    form = HostForm(torch.bfloat16, HostBuffers(CPU))
    stale = load_peft_adapter("a", adapter_dir, CFG, 64, form=form)
    block = stale.packed.data_ptr()
    stale.packed.fill_(float("nan"))
    del stale
    held = load_peft_adapter("a", adapter_dir, CFG, 64, form=form)
    assert held.packed.data_ptr() == block and held.packed.dtype == torch.bfloat16
    places, _ = held.packed_layout
    for ((layer, module), w), (_, b_at) in zip(held.modules.items(), places, strict=True):
        key = f"base_model.model.model.layers.{layer}.{'self_attn' if module == 'q_proj' else 'mlp'}.{module}"
        assert torch.equal(w.a, ref[f"{key}.lora_A.weight"].to(torch.bfloat16))
        assert torch.equal(w.b, ref[f"{key}.lora_B.weight"].to(torch.bfloat16))
        rows = held.packed[b_at : b_at + w.b.shape[0] * 8].view(-1, 8)
        assert rows[:, 6:].eq(0).all()


def test_integer_weights_and_files_that_shrink_while_read_are_refused(adapter_dir, tmp_path, monkeypatch):
    ints = shutil.copytree(adapter_dir, tmp_path / "ints")
    tensors = load_file(str(ints / WEIGHTS))
    save_file({k: v.to(torch.int32) for k, v in tensors.items()}, str(ints / WEIGHTS))
    with pytest.raises(AdapterError, match="dtype I32 is not a float type"):
        load_peft_adapter("ints", ints, CFG, 64)
    monkeypatch.setattr(reading.os, "preadv", lambda fd, buffers, offset: 0)  # the file was truncated
    with pytest.raises(AdapterError, match="changed while read"):
        load_peft_adapter("a", adapter_dir, CFG, 64)
