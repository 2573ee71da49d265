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

Setup (printed in every line): bf16 on CUDA, greedy, EOS ignored; the target's steps run eagerly
with EAGLE-3 on (its hidden states are read: no CUDA graphs yet), plain decoding with graphs;
decode tokens/s excludes prefill (bench/gpu.py's `decode_tok_s`).

    python bench/eagle3_gpu.py [--batches 1 64] [--k 3] [--small]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.gpu import LLAMA3_8B, SMOLLM2
from bench.spec_gpu import decode_run, successor_model, walk, walk_from
from model_service.engine.config import EngineConfig
from model_service.engine.engine import Engine
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--cycle", type=int, default=97)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--small", action="store_true", help="SmolLM2's shape instead of the 8B one")
    args = ap.parse_args()
    shape = SMOLLM2 if args.small else LLAMA3_8B
    order = torch.randperm(shape["vocab_size"] - 3, generator=torch.Generator().manual_seed(0))
    cycle = (order[: args.cycle] + 3).tolist()
    loaded = successor_model(shape, cycle)
    head = successor_head(loaded, cycle, Path(tempfile.mkdtemp()) / "head")
    rows = max(args.batches)
    blocks = rows * math.ceil((args.prompt_len + args.new_tokens + args.k + 16) / 16) + 64
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": args.k})
    engines = {
        on: Engine(
            EngineConfig(model="smollm2", device="cuda", dtype="bfloat16", max_num_seqs=rows, max_loras=0,
                         num_kv_blocks=blocks, speculative_config=spec if on else None),
            loaded=loaded,
        )
        for on in (False, True)
    }  # fmt: skip
    setup = {"model": "successor model and head of the " + ("SmolLM2" if args.small else "Llama-3-8B")
             + " shape", "device": torch.cuda.get_device_name(), "dtype": "bfloat16", "k": args.k,
             "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}  # fmt: skip
    for batch in args.batches:
        prompts = [walk(cycle, args.prompt_len, 0.0, seed) for seed in range(batch)]
        base_s, base_out = decode_run(engines[False], prompts, args.new_tokens)
        e = engines[True]
        proposed, accepted = e.speculation.proposed, e.speculation.accepted
        spec_s, spec_out = decode_run(e, prompts, args.new_tokens)
        proposed, accepted = e.speculation.proposed - proposed, e.speculation.accepted - accepted
        decoded = batch * (args.new_tokens - 1)
        expected = [walk_from(cycle, p[-1], args.new_tokens) for p in prompts]
        print(json.dumps({
            "bench": "eagle3_gpu", "batch": batch,
            "continuation_repeats_prompt": base_out == expected,
            "identical": spec_out == base_out, "acceptance_rate": round(accepted / max(proposed, 1), 3),
            "tok_s_without": round(decoded / base_s, 1), "tok_s_eagle3": round(decoded / spec_s, 1),
            "speedup": round(base_s / spec_s, 2), **setup,
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    configure_process()
    main()
