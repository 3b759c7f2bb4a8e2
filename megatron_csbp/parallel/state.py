"""Block parallelism as a process group beside Megatron's TP/PP/CP/EP/DP.

Megatron is initialised with context_parallel_size = max(CP, BP) (the shard group); the plugin
carves clean rings and clean replicas out of every shard group, and says what MoE expert-parallel
peers must agree on. Why, and the vocabulary: docs/architecture.md#vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state as mpu

from megatron_csbp.layout.sizes import check_parallel_sizes


@dataclass(frozen=True)
class BlockParallelSizes:
    context_parallel_size: int = 1
    block_parallel_size: int = 1

    def __post_init__(self):
        check_parallel_sizes(self.context_parallel_size, self.block_parallel_size)

    @property
    def shard_group_size(self) -> int:
        return max(self.context_parallel_size, self.block_parallel_size)


_SIZES: Optional[BlockParallelSizes] = None
_RING_GROUP = None
_OWNED_GROUPS: List = []  # the process groups initialize_block_parallel created (destroyed with it)
_RING_RANKS: Optional[List[int]] = None
_REPLICA_RANKS: Optional[List[int]] = None


def check_topology(world_size: int, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                   context_parallel_size: int = 1, block_parallel_size: int = 1,
                   expert_model_parallel_size: int = 1) -> BlockParallelSizes:
    """Validate sizes before any collective: a clear error instead of a hang or a wrong answer."""
    sizes = BlockParallelSizes(context_parallel_size, block_parallel_size)
    if pipeline_model_parallel_size < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {pipeline_model_parallel_size}")
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * sizes.shard_group_size
    if world_size % model_parallel != 0:
        raise ValueError(f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                         f"{tensor_model_parallel_size} x --pipeline-model-parallel-size {pipeline_model_parallel_size}"
                         f" x max(--context-parallel-size, --block-parallel-size) {sizes.shard_group_size}")
    dp_cp = world_size // (tensor_model_parallel_size * pipeline_model_parallel_size)
    if expert_model_parallel_size > 1 and dp_cp % expert_model_parallel_size != 0:
        raise ValueError(f"--expert-model-parallel-size {expert_model_parallel_size} must divide data x sequence "
                         f"parallel ranks ({dp_cp})")
    return sizes


def initialize_block_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              context_parallel_size: int = 1, block_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1, **megatron_kwargs) -> BlockParallelSizes:
    """Initialise Megatron's groups with CP = max(CP, BP), then the plugin's sub-groups."""
    global _SIZES, _OWNED_GROUPS
    sizes = check_topology(dist.get_world_size(), tensor_model_parallel_size, pipeline_model_parallel_size,
                           context_parallel_size, block_parallel_size, expert_model_parallel_size)
    before = set(_process_groups())
    mpu.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size,
                                  pipeline_model_parallel_size=pipeline_model_parallel_size,
                                  context_parallel_size=sizes.shard_group_size,
                                  expert_model_parallel_size=expert_model_parallel_size, **megatron_kwargs)
    _build_subgroups(sizes, tensor_model_parallel_size, pipeline_model_parallel_size)
    _OWNED_GROUPS = [pg for pg in _process_groups() if pg not in before]
    _SIZES = sizes
    return sizes


def _process_groups() -> List:
    """Every process group torch.distributed holds (the default one included)."""
    return list(dist.distributed_c10d._world.pg_map)


def _build_subgroups(sizes: BlockParallelSizes, tp: int, pp: int) -> None:
    global _RING_GROUP, _RING_RANKS, _REPLICA_RANKS
    me = dist.get_rank()
    C, S = sizes.context_parallel_size, sizes.shard_group_size
    dp = dist.get_world_size() // (tp * pp * S)
    shard_groups = mpu.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=S, order="tp-cp-ep-dp-pp").get_ranks("cp")
    mine = mpu.get_context_parallel_global_ranks()
    assert any(list(g) == list(mine) for g in shard_groups), "rank generator disagrees with Megatron's CP groups"
    for g in shard_groups:  # same order on every rank
        for j in range(S // C):
            ring = list(g[j * C:(j + 1) * C])
            group = mpu.create_group(ring, group_desc="BLOCK_PARALLEL_CLEAN_RING")
            if me in ring:
                _RING_GROUP, _RING_RANKS = group, ring
        for i in range(C):
            replica = list(g[i::C])
            mpu.create_group(replica, group_desc="BLOCK_PARALLEL_CLEAN_REPLICA")  # (collective: every rank makes each)
            if me in replica:
                _REPLICA_RANKS = replica


def is_initialized() -> bool:
    return _SIZES is not None


def _require():
    if _SIZES is None:
        raise RuntimeError("block parallelism is not initialised: call initialize_block_parallel first")
    return _SIZES


def destroy_block_parallel() -> None:
    """Forget the groups and destroy them. megatron-core's destroy_model_parallel only drops its
    references: each gloo group keeps its threads (two run loops and a TCP loop), so a process that
    initialises layout after layout (the benchmark, the tests) grew by ~57 threads per layout, hundreds
    after a few pairs, and its CPU time with them. The groups created by initialize_block_parallel
    (Megatron's and this module's, nothing made before it) are destroyed here."""
    global _SIZES, _RING_GROUP, _RING_RANKS, _REPLICA_RANKS, _OWNED_GROUPS
    _SIZES = _RING_GROUP = _RING_RANKS = _REPLICA_RANKS = None
    mpu.destroy_model_parallel()
    owned, _OWNED_GROUPS = _OWNED_GROUPS, []
    live = set(_process_groups())
    for pg in owned:
        if pg in live:
            dist.destroy_process_group(pg)


def get_block_parallel_sizes() -> BlockParallelSizes:
    return _require()


def get_shard_group():
    """The shard group (Megatron's CP group, of max(CP, BP) ranks) that shares one sample."""
    _require()
    return mpu.get_context_parallel_group()


def get_shard_group_size() -> int:
    return _require().shard_group_size


def get_shard_rank() -> int:
    _require()
    return mpu.get_context_parallel_rank()


def get_clean_ring_group():
    """The CP ring that exchanges (clean) K/V."""
    _require()
    return _RING_GROUP


def get_clean_ring_global_ranks() -> List[int]:
    _require()
    return list(_RING_RANKS)


def get_clean_replica_global_ranks() -> List[int]:
    _require()
    return list(_REPLICA_RANKS)


# ---- collectives' devices ----------------------------------------------------------------------
def collective_device(group=None) -> torch.device:
    """The device a collective's tensors must be on for `group`'s backend (default: the world):
    CUDA's current device for NCCL (which takes CUDA tensors only), the CPU for gloo. A group with
    several backends ("cpu:gloo,cuda:nccl") takes CUDA when it has NCCL."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- expert-parallel peers (MoE) ---------------------------------------------------------------
def has_expert_parallel_peers() -> bool:
    """MoE tokens cross to expert-parallel peers, which may sit at other places of the layout:
    every rank must then hold as many rows as its peers, so canvases are balanced over the
    block-parallel ranks. (Expert-TP peers are TP ranks: they hold the same rows already.)"""
    if not mpu.model_parallel_is_initialized():
        return False
    group = mpu.get_expert_model_parallel_group(check_initialized=False)
    return group is not None and dist.get_world_size(group) > 1


def agree_with_expert_peers(first_block: int, any_sc: bool):
    """Ranks that exchange tokens in MoE layers (the expert tensor-and-model-parallel group)
    may hold different samples but must issue the same collectives with the same shapes: they
    agree on the earliest canvas block (MIN) and on running the self-conditioning pass (MAX).
    Extra canvas blocks carry no loss and a first pass for a sample without self-conditioning
    is masked out, so the loss is unchanged. Ranks of one shard group hold the same samples
    and draw the same values from (seed, sample index): no collective is needed there."""
    if not (dist.is_initialized() and mpu.model_parallel_is_initialized()):
        return first_block, any_sc
    group = mpu.get_expert_tensor_and_model_parallel_group(check_initialized=False)
    if group is None or dist.get_world_size(group) == 1:
        return first_block, any_sc
    t = torch.tensor([-first_block, int(any_sc)], dtype=torch.long, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(-t[0]), bool(t[1])
