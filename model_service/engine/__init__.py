"""The serving engine: engine, scheduler, cache manager, executor, step batch, sampler, outputs."""
