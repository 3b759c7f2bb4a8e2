"""Run a function on N CPU ranks with gloo and collect each rank's return value.

`run_distributed(fn, world_size, *args)`: `fn(rank, world_size, *args)` must be importable
(module level); see `megatron_csbp.parallel.spawn`, which the benchmark uses too.
"""
from megatron_csbp.parallel.spawn import spawn as run_distributed

__all__ = ["run_distributed"]
