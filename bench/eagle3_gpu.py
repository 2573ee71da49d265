"""What EAGLE-3 speculation gains on a GPU for the 8B shape, with a head whose proposals are known.

Random heads are never accepted, so as bench/spec_gpu.py builds a *successor model* of the
Llama-3-8B shape (greedy decoding walks a fixed cycle of token ids; every weight is read, so a
step costs what a real 8B step costs), this builds an EAGLE-3 head of the 8B head's shape
(hidden 4096, MLP 14336, a 32,000-token vocabulary mapped by `d2t`, `fc` over three layers' states)
that predicts the successor of the token it reads: its attention attends each position to itself
on the embedding half of its input and passes that half through v and o_proj (10x: it
outweighs the residual, which is the normed hidden: `norm_before_residual`), its MLP adds nothing,
and its LM head maps the embedding of cycle[i] to cycle[i + 1]. Every proposal is accepted; what
the bench measures is the cost of the head's k steps and the verify against plain decoding.
The head has 32 KV heads (the real 8B head has 8): v must carry the whole 4096-wide embedding.

Setup (printed in every line): bf16 on CUDA, greedy, EOS ignored; decode and verify steps and the
head's steps replay CUDA graphs (engine/cuda_graphs.py), as plain decoding's do; decode tokens/s
excludes prefill (bench/gpu.py's `decode_tok_s`); tokens_per_step: what a sequence's verify step
emits on average (1 + k at acceptance 1.0).

    python bench/eagle3_gpu.py [--batches 1 64] [--k 3] [--small]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.spec_gpu import compare, plain_and_speculative, successor_parser, successor_setup, walk
from model_service.models.loader import LoadedModel
from model_service.startup import configure_process

DRAFT_VOCAB = 32_000


def successor_head(target: LoadedModel, cycle: list[int], path: Path) -> Path:
    """An EAGLE-3 head checkpoint at `path` (the module docstring's) for the successor model."""
    cfg = target.config
    hidden, heads, inter = cfg.hidden_size, cfg.num_heads, cfg.intermediate_size
    dim = hidden // heads
    embed = target.module.model.embed_tokens.weight.detach().float().cpu()
    g = torch.Generator().manual_seed(0)
    walked = set(cycle)
    rest = [t for t in torch.randperm(cfg.vocab_size, generator=g).tolist() if t not in walked]
    ids = torch.tensor(sorted(cycle + rest[: DRAFT_VOCAB - len(cycle)]))
    head = torch.zeros(DRAFT_VOCAB, hidden)
    position = {int(t): i for i, t in enumerate(ids)}
    for i, t in enumerate(cycle):
        head[position[cycle[(i + 1) % len(cycle)]]] = embed[t]
    select = torch.zeros(heads * dim, 2 * hidden)
    select[:, :hidden] = torch.eye(hidden)
    m = "midlayer."
    tensors = {
        m + "input_layernorm.weight": torch.ones(hidden),
        m + "hidden_norm.weight": torch.ones(hidden),
        m + "post_attention_layernorm.weight": torch.ones(hidden),
        m + "self_attn.q_proj.weight": 2 * select,
        m + "self_attn.k_proj.weight": 2 * select,
        m + "self_attn.v_proj.weight": select,
        m + "self_attn.o_proj.weight": 10 * torch.eye(hidden),
        m + "mlp.gate_proj.weight": torch.randn(inter, hidden, generator=g) * 0.02,
        m + "mlp.up_proj.weight": torch.randn(inter, hidden, generator=g) * 0.02,
        m + "mlp.down_proj.weight": torch.zeros(hidden, inter),
        "fc.weight": torch.randn(hidden, 3 * hidden, generator=g) * 0.01,
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": head,
        "d2t": ids - torch.arange(DRAFT_VOCAB),
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()},
              str(path / "model.safetensors"))  # fmt: skip
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": dim,
        "num_hidden_layers": 1, "rms_norm_eps": cfg.rms_norm_eps, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": DRAFT_VOCAB, "rope_theta": cfg.rope_theta, "norm_before_residual": True,
        "max_position_embeddings": cfg.max_position_embeddings,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


def main() -> None:
    args = successor_parser(__doc__, k=3).parse_args()
    loaded, cycle = successor_setup(args)
    head = successor_head(loaded, cycle, Path(tempfile.mkdtemp()) / "head")
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": args.k})
    engines = plain_and_speculative(loaded, args, spec)
    setup = {"model": "successor model and head of the " + ("SmolLM2" if args.small else "Llama-3-8B")
             + " shape", "device": torch.cuda.get_device_name(), "dtype": "bfloat16", "k": args.k,
             "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}  # fmt: skip
    for batch in args.batches:
        prompts = [walk(cycle, args.prompt_len, 0.0, seed) for seed in range(batch)]
        result = compare(engines, cycle, prompts, args.new_tokens)
        print(json.dumps({"bench": "eagle3_gpu", "batch": batch, **result, **setup}), flush=True)


if __name__ == "__main__":
    configure_process()
    main()
