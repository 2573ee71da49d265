"""Many LoRA adapters in one engine: PEFT loading, the slot pool, the batched delta."""
