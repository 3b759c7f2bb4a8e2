"""The adapters' ShardedTensors (dist checkpoints independent of the layout)."""
from __future__ import annotations


def column_adapter_shards(layer, sd, prefix, sharded_offsets, metadata):
    return sd


def row_adapter_shards(layer, sd, prefix, sharded_offsets, metadata):
    return sd
