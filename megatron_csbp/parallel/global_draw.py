"""Layout-independent initial weights: a weight is drawn in full from a generator seeded by (--seed, its
*global* name) and each rank keeps its tensor-parallel slice, so every layout starts from the same model.
Used for a flag-built MoE's base weights (`model.assemble.redraw_weights_by_global_name`) and for LoRA
adapters (`lora.init.draw_adapters`). Size: one full weight at a time."""
from __future__ import annotations

import zlib
from typing import Callable, Sequence, Tuple

import torch

from megatron_csbp.parallel import pipeline


class GlobalNames:
    """Names of one model chunk made global: this chunk's layer i is layer offset + i, this EP rank's local
    expert i is expert first_expert + i."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core import parallel_state as mpu

        config = model.config
        experts = getattr(config, "num_moe_experts", None) or 0
        self.first_expert = experts // mpu.get_expert_model_parallel_world_size() * mpu.get_expert_model_parallel_rank()
        self.layer_offset = pipeline.first_layer(config, getattr(model, "vp_stage", None))

    def parts(self, name: str) -> list:
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"] and len(parts) > 2:
            parts[2] = str(self.layer_offset + int(parts[2]))
        if "local_experts" in parts[:-1]:
            k = parts.index("local_experts") + 1
            parts[k] = str(self.first_expert + int(parts[k]))
        return parts


def tensor_parallel_rank(expert: bool) -> Tuple[int, int]:
    """(rank, world) of this rank's tensor-parallel group: expert TP for expert weights."""
    from megatron.core import parallel_state as mpu

    if expert:
        return mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size()
    return mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()


def tensor_parallel_slice(weight: torch.Tensor, expert: bool) -> Tuple[int, int, int, int]:
    """(dim, stride, rank, world) of `weight`'s tensor-parallel split; (0, 1, 0, 1) if it is not split."""
    if not getattr(weight, "tensor_model_parallel", False):
        return 0, 1, 0, 1
    return (weight.partition_dim, weight.partition_stride, *tensor_parallel_rank(expert))


def drawn_slice(parts: Sequence[str], local_shape, fill: Callable[[torch.Tensor], None], seed: int, dim: int,
                stride: int, rank: int, world: int) -> torch.Tensor:
    """The weight named `parts`, drawn in full (float32) by `fill` from a generator seeded by (seed, name),
    and the slice tensor-parallel rank `rank` of `world` holds along `dim` (`stride` interleaved pieces, as
    Megatron's CPU initialisation splits it)."""
    full = list(local_shape)
    full[dim] *= world
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + zlib.crc32(".".join(parts).encode()))
        master = torch.empty(full, dtype=torch.float32)
        fill(master)
    pieces = torch.split(master, local_shape[dim] // stride, dim=dim)
    return torch.cat(pieces[rank::world], dim=dim)
