"""The models and what they are built and called with.

- `config`: `ModelConfig`, read from an HF `config.json` or a GGUF file's metadata;
- `registry`: architecture -> module class; `llama` (`DecoderModel`, dense decoders),
  `moe` (sparse-MoE blocks and their routing), `qwen3_next` (the hybrid of attention and
  gated-delta layers), `deepseek` (multi-head latent attention over a latent cache, DeepSeek MoE),
  built from `layers`, `rope`, `gated_delta`;
- `loader`, `gguf_weights`, `expert_weights`: checkpoints and GGUF files into those modules;
  `tokenizer`;
- `step`: `StepBatch`, one forward pass's input, and the `AttentionBackend` (and MLA's
  `LatentAttentionBackend`) / `GraphCapturable` protocols, the seam between a model and its
  attention backend; `context`: `ForwardContext`, what every layer of one call reads;
  `recurrent`: the `RecurrentModel` protocol of models with per-sequence state, and their
  step's plan.

A module is called as `module(input_ids, positions, ctx)`. LoRA wraps its projections from
outside (`lora/layers.py`) and attention runs in the backend `ctx` carries, so no model code knows
either.
"""
