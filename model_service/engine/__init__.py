"""The serving engine: scheduler, block manager, model runner, sampler, detokenizer."""
