"""Tiny random checkpoints for EAGLE-3 tests: a Llama target (HF `transformers`, safetensors) and an
EAGLE-3 head for it in the real format (`LlamaForCausalLMEagle3`, `midlayer.*`, `fc`, a reduced
vocabulary with `d2t`). No conftest imports: the GPU test (tests/test_eagle3_gpu.py) runs with
`--noconftest`.

Random heads never agree with their target, so `agree=True` builds one that partly does: the
target's layers write little into the residual stream (output projections scaled down), so it
predicts the token after t from t alone, about lm_head(norm(embed(t))); the head's attention
attends each position to itself on the embedding half of its input (q = k = a multiple of the
normed embedding, per head) and passes that half through v and o_proj, its `fc` and MLP are
small, and its LM head is the target's rows for its vocabulary: so it proposes what the target
would say after the token it reads, whenever that token is in its vocabulary (about 60% of the
target's). Both the accept and the rollback paths run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB = 320, 64, 4, 200
SCALE, O_SCALE = 0.002, 10.0
HEADS, HEAD_DIM = 4, 32  # the head's attention: 4 heads of 32 (q/k/v 128 wide from 2 * 64 inputs)


def make_target(path: Path, agree: bool, seed: int = 0) -> Path:
    """A 4-layer Llama of random weights (N(0, 0.2)); `agree`: output projections scaled by 0.01."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
                if agree and name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(SCALE)
    model.save_pretrained(path, safe_serialization=True)
    return path


def head_config(aux: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    """The head's config.json, as EAGLE-3's trainers write it (a Llama config of one layer)."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 128, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB, "max_position_embeddings": 512, "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }  # fmt: skip
    if aux is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}
    return cfg | extra


def make_head(path: Path, target: Path, agree: bool, aux: list[int] | None = None, seed: int = 1) -> Path:
    """An EAGLE-3 head for `target` at `path`; `agree`: the head the module docstring describes,
    else random weights throughout (and an embedding of its own)."""
    g = torch.Generator().manual_seed(seed)
    t = load_file(str(target / "model.safetensors"))
    ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values  # the head's vocabulary

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm() -> torch.Tensor:
        return 1 + 0.3 * torch.randn(HIDDEN, generator=g)

    width = HEADS * HEAD_DIM
    m = "midlayer."
    tensors = {
        m + "input_layernorm.weight": torch.ones(HIDDEN) if agree else norm(),
        m + "hidden_norm.weight": norm(),
        m + "post_attention_layernorm.weight": torch.ones(HIDDEN) if agree else norm(),
        m + "mlp.gate_proj.weight": rand(128, HIDDEN),
        m + "mlp.up_proj.weight": rand(128, HIDDEN),
        m + "mlp.down_proj.weight": rand(HIDDEN, 128, scale=0.002 if agree else 0.2),
        "fc.weight": rand(HIDDEN, 3 * HIDDEN, scale=0.002 if agree else 0.1),
        "norm.weight": torch.ones(HIDDEN) if agree else norm(),
        "d2t": ids - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, ids, True),
    }
    if agree:
        select = torch.zeros(width, 2 * HIDDEN)  # heads 0 and 1 read the embedding half, 32 dims each
        select[:HIDDEN, :HIDDEN] = torch.eye(HIDDEN)
        tensors |= {
            m + "self_attn.q_proj.weight": 2 * select,
            m + "self_attn.k_proj.weight": 2 * select,
            m + "self_attn.v_proj.weight": select,
            m + "self_attn.o_proj.weight": O_SCALE * select[:, :HIDDEN].T.contiguous(),
            "lm_head.weight": t["lm_head.weight"][ids].clone(),
        }
    else:
        tensors |= {
            m + "self_attn.q_proj.weight": rand(width, 2 * HIDDEN),
            m + "self_attn.k_proj.weight": rand(width, 2 * HIDDEN),
            m + "self_attn.v_proj.weight": rand(width, 2 * HIDDEN),
            m + "self_attn.o_proj.weight": rand(HIDDEN, width),
            "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN),
            "embed_tokens.weight": rand(VOCAB, HIDDEN, scale=1.0),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    # agree: the residual is the normed hidden, which the attention's 10x embedding outweighs
    # (a chained step's hidden is the head's last output: as the raw residual, it would drown it)
    (path / "config.json").write_text(json.dumps(head_config(aux, norm_before_residual=agree)))
    return path


def eagle3_config(head: Path, k: int) -> str:
    return json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k})
