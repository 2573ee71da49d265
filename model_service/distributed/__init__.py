"""Tensor parallelism: one model pod over several devices of its host, one process per device.

Rank 0 runs the engine and its `TensorParallelExecutor` (executor.py); ranks 1..N-1 are worker
processes it spawns and watches (worker.py) that run the commands it broadcasts (link.py) on
their shard (rank.py, sharding.py), whose layers talk over the device group (layers.py).
"""
