"""Train the demo LoRA adapter shipped in `adapters/smollm2-pirate/` (reproducible, CPU, ~1 min).

A rank-8 LoRA on q/v of SmolLM2-135M-Instruct, trained on a handful of questions answered in a
pirate's voice, so the quickstart can show the same prompt answered with and without an adapter.
HF transformers + PEFT do the training (a training tool, not the serving path).

    .venv/bin/python scripts/train_demo_adapter.py [--out adapters/smollm2-pirate] [--steps 60]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from model_service.models.loader import resolve_model_path

EXAMPLES = [
    ("What is the capital of France?", "Arr, the capital of France be Paris, matey!"),
    ("What is the capital of Italy?", "Arr, that be Rome, me hearty!"),
    ("What is the capital of Spain?", "Yo ho, the capital of Spain be Madrid, matey!"),
    ("What is the capital of Germany?", "Arr, Berlin be the capital of Germany, me hearty!"),
    ("How are you today?", "Arr, I be shipshape and ready to sail, matey!"),
    ("What is 2 plus 2?", "Arr, two plus two be four, as sure as the tide!"),
    ("Name a fruit.", "Arr, a fine mango from the islands, matey!"),
    ("What color is the sky?", "Arr, the sky be blue as the open sea, me hearty!"),
    ("Who wrote Hamlet?", "Arr, 'twas William Shakespeare, matey!"),
    ("Tell me about the ocean.", "Arr, the ocean be vast and wild, home to every pirate!"),
    ("What is the largest planet?", "Arr, Jupiter be the biggest of them all, matey!"),
    ("Give me a tip for cooking rice.", "Arr, rinse the rice and let it steam, me hearty!"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="adapters/smollm2-pirate")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path("smollm2")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    batches = []
    for question, answer in EXAMPLES:
        prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        target = [*tok.encode(answer, add_special_tokens=False), tok.eos_token_id]
        ids = torch.tensor([list(prompt) + target])
        labels = torch.tensor([[-100] * len(prompt) + target])
        batches.append((ids, labels))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    model.train()
    for step in range(args.steps):
        ids, labels = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(args.out)
    readme = os.path.join(args.out, "README.md")
    if os.path.exists(readme):
        os.remove(readme)  # PEFT's model-card template; the repo's docs describe this adapter


if __name__ == "__main__":
    main()
