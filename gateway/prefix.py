"""Prefix locality: which pod most likely still holds a prompt's leading KV blocks.

The engine's own prefix-cache keys are process-local `hash()` values, useless across processes,
so the gateway keeps its own (as the Gateway API Inference Extension does): the prompt is cut
into fixed blocks of bytes, each block's hash chains the previous one (a block's hash therefore
names the whole prefix up to it), and an LRU index remembers which pods were sent which hashes.
A request scores each pod by the fraction of its leading blocks that pod has seen.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from spindle.v1 import generation_pb2 as pb

BLOCK_BYTES = 64
MAX_BLOCKS = 256  # longer prompts are matched on their first 16 KiB: enough to tell them apart


def prompt_bytes(req: pb.GenerateRequest) -> bytes:
    """A canonical byte form of the prompt: equal prompts give equal bytes, in any process."""
    which = req.WhichOneof("prompt")
    if which == "text":
        return b"T" + req.text.encode()
    if which == "chat":  # tools first: templates render them in the first (system) turn
        tools = b"".join(t.SerializeToString(deterministic=True) + b"\x1e" for t in req.chat.tools)
        return b"C" + tools + b"".join(_message_bytes(m) for m in req.chat.messages)
    if which == "token_ids":
        return b"I" + struct.pack(f"<{len(req.token_ids.ids)}i", *req.token_ids.ids)
    return b""


def _message_bytes(m: pb.ChatMessage) -> bytes:
    """A message's role and content, and its tool calls and result id where it has them."""
    extra = b"".join(c.SerializeToString(deterministic=True) for c in m.tool_calls) + m.tool_call_id.encode()
    return m.role.encode() + b"\x1f" + m.content.encode() + (b"\x1d" + extra if extra else b"") + b"\x1e"


def block_hashes(req: pb.GenerateRequest) -> list[bytes]:
    """Chained hashes of the prompt's full blocks. The model and adapter seed the chain: the same
    text under another adapter has different KV."""
    data = prompt_bytes(req)[: BLOCK_BYTES * MAX_BLOCKS]
    seed = f"{req.model if req.HasField('model') else ''}\x00{req.adapter if req.HasField('adapter') else ''}"
    prev = hashlib.blake2b(seed.encode(), digest_size=16).digest()
    out = []
    for i in range(len(data) // BLOCK_BYTES):
        prev = hashlib.blake2b(prev + data[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES], digest_size=16).digest()
        out.append(prev)
    return out


class PrefixIndex:
    """block hash -> pods it was sent to, least recently used dropped first."""

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._pods: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pods)

    def match(self, hashes: list[bytes], pods: list[str]) -> dict[str, float]:
        """For each pod, the fraction of the prompt's leading blocks it has seen (0..1)."""
        scores = dict.fromkeys(pods, 0.0)
        if not hashes:
            return scores
        alive = set(pods)
        for i, h in enumerate(hashes):
            holders = self._pods.get(h)
            if not holders or not holders & alive:
                break
            for pod in holders & alive:
                scores[pod] = (i + 1) / len(hashes)
            alive &= holders  # a chain broken for a pod stays broken
        return scores

    def record(self, hashes: list[bytes], pod: str) -> None:
        for h in hashes:
            holders = self._pods.get(h)
            if holders is None:
                self._pods[h] = {pod}
            else:
                holders.add(pod)
                self._pods.move_to_end(h)
        while len(self._pods) > self.capacity:
            self._pods.popitem(last=False)

    def forget_pod(self, pod: str) -> None:
        """A pod that failed lost its cache; stop sending its old prompts there."""
        for h in [h for h, holders in self._pods.items() if pod in holders]:
            holders = self._pods[h]
            holders.discard(pod)
            if not holders:
                del self._pods[h]
