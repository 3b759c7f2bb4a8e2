"""Block-parallel process groups beside Megatron's, and ranks without targets."""
from __future__ import annotations

import pytest
import torch

from megatron_csbp.parallel.state import check_topology
from tests.distributed import run_distributed


def _groups_rank(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_csbp.parallel import state as bps

    out = {}
    for tp, cp, bp in [(1, 2, 4), (2, 2, 2), (1, 4, 1), (1, 1, 2)]:
        bps.initialize_block_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp, block_parallel_size=bp)
        out[(tp, cp, bp)] = dict(
            seq_size=bps.get_shard_group_size(),
            shard_rank=bps.get_shard_rank(),
            seq_ranks=dist.get_process_group_ranks(bps.get_shard_group()),
            ring=bps.get_clean_ring_global_ranks(),
            replica=bps.get_clean_replica_global_ranks(),
            dp_cp=dist.get_process_group_ranks(mpu.get_data_parallel_group(with_context_parallel=True)),
            tp_ranks=dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group()),
        )
        bps.destroy_block_parallel()
    out["zero_target"] = _zero_target_rank()
    return out


def _zero_target_rank():
    """BP = 4 where only block 0 has targets: ranks owning no target still return a zero loss
    attached to every parameter, so every gradient hook fires."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_csbp.parallel import state as bps
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.model.spec import with_block_diffusion_attention
    from megatron_csbp.objectives import BD3LMObjective

    bps.initialize_block_parallel(block_parallel_size=4)
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                               use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    gpt = GPTModel(config, with_block_diffusion_attention(get_gpt_layer_local_spec()), vocab_size=32,
                   max_sequence_length=32, position_embedding_type="rope")
    layout = SequenceLayout(BlockGeometry(32, 4), 1, 4)
    model = BlockDiffusionModel(gpt, BD3LMObjective(4, 31, eps_min=1.0), layout, bps.get_shard_rank())
    tokens = torch.randint(0, 31, (1, 32))
    loss_mask = torch.zeros_like(tokens)
    loss_mask[:, :4] = 1  # only block 0 (owned by seq rank 0) is supervised; eps_min=1 masks it all
    out = model(tokens, loss_mask)
    out.loss.backward()
    result = dict(loss=float(out.loss), targets=int(out.num_targets), requires_grad=out.loss.requires_grad,
                  all_grads=all(p.grad is not None for p in gpt.parameters()))
    bps.destroy_block_parallel()
    return result


def test_groups_and_zero_target_ranks():
    results = run_distributed(_groups_rank, 4)
    for rank, res in enumerate(results):
        # CP=2, BP=4: one shard group of 4, two rings of 2, replicas across rings.
        g = res[(1, 2, 4)]
        assert g["seq_size"] == 4 and g["seq_ranks"] == [0, 1, 2, 3] and g["shard_rank"] == rank
        assert g["ring"] == ([0, 1] if rank < 2 else [2, 3])
        assert g["replica"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert g["dp_cp"] == [0, 1, 2, 3]  # DDP reduces over the block-parallel ranks too
        # TP=2 innermost: the shard group joins ranks of equal TP rank.
        g = res[(2, 2, 2)]
        assert g["tp_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        assert g["seq_ranks"] == ([0, 2] if rank % 2 == 0 else [1, 3]) and g["ring"] == g["seq_ranks"]
        assert g["dp_cp"] == g["seq_ranks"]
        # CP only: the ring is the whole group; BP only: rings of one rank.
        assert res[(1, 4, 1)]["ring"] == [0, 1, 2, 3]
        g = res[(1, 1, 2)]
        assert g["ring"] == [rank] and g["seq_ranks"] == ([0, 1] if rank < 2 else [2, 3])
        z = res["zero_target"]
        assert z["requires_grad"] and z["all_grads"]
        if rank == 0:
            assert z["targets"] == 4 and z["loss"] > 0
        else:
            assert z["targets"] == 0 and z["loss"] == 0.0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(world_size=4, context_parallel_size=2, block_parallel_size=3), "multiple of --context-parallel-size"),
        (dict(world_size=6, block_parallel_size=4), "not divisible by"),
        (dict(world_size=8, tensor_model_parallel_size=2, block_parallel_size=8), "not divisible by"),
        (dict(world_size=4, pipeline_model_parallel_size=0, block_parallel_size=2), "--pipeline-model-parallel-size must be >= 1"),
        (dict(world_size=4, block_parallel_size=4, expert_model_parallel_size=3), "expert-model-parallel"),
        (dict(world_size=4, block_parallel_size=0), "must be >= 1"),
    ],
)
def test_impossible_topologies_are_refused_before_any_collective(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_topology(**kwargs)


def _reinit_rank(rank, world):
    """Initialise and destroy two layouts in one process: the groups and their gloo threads go."""
    import torch.distributed as dist

    from megatron_csbp.parallel import state as bps

    def threads():
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Threads")).split()[1])

    groups0, threads0 = len(dist.distributed_c10d._world.pg_map), threads()
    out = []
    for cp, bp in ((2, 2), (1, 2)):
        bps.initialize_block_parallel(1, 1, cp, bp, 1)
        made = len(dist.distributed_c10d._world.pg_map) - groups0
        bps.destroy_block_parallel()
        out.append((made, len(dist.distributed_c10d._world.pg_map) - groups0, threads() - threads0))
    return out


def test_destroy_releases_the_groups_and_their_threads():
    # Before the fix each layout left its ~19 gloo groups (57 threads) behind in the process.
    for per_rank in run_distributed(_reinit_rank, 2):
        for made, left, extra_threads in per_rank:
            assert made > 0 and left == 0, per_rank
        # A few threads torch starts once (its pools) stay; none per group: the count does not grow.
        assert len({extra for _, _, extra in per_rank}) == 1 and per_rank[0][2] < per_rank[0][0], per_rank
