"""Model families under PP 2 x CSBP (CP 2 + BP 2, 4 ranks) through megatron-core's 1F1B schedule,
Megatron's DDP and `finalize_model_grads`: the loss and every parameter gradient equal one rank's,
with more micro-batches (4) than stages.

- DiffusionGemma (tiny: sliding, full, sliding, full; K=V full layers, 4 experts, top-2, tied
  soft-capped output): each stage holds one sliding and one full layer (global layer numbers
  choose the kind), and its MoE layers run expert parallelism EP = 2 over the stage's shard group
  (each rank 2 experts). float64 except Megatron's fp32 router softmax: MOE_TOL (tests/gradients.py).
- A Qwen3.5-style hybrid (Gated DeltaNet, attention, GDN, attention): the layer-type pattern
  split across the stages, each GDN's state inside its stage. float64: FP64_TOL.

Each rank computes the one-rank reference in-process first (PP = 1, the micro-batches one after
the other), then its stage's chunk with the reference weights copied in by global name.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.gradients import (EXACT_DTYPE, FP64_TOL, MOE_TOL, check_close, gradient_error, one_rank_reference,
                             pipeline_forward_step)

pytestmark = pytest.mark.exactness

V, B, MBS, M, EXPERTS = 96, 4, 2, 4, 4
PATTERN = (1, 0, 1, 0)


def _objective():
    from megatron_csbp.objectives import BD3LMObjective

    return BD3LMObjective(B, mask_token_id=V - 1, seed=3)


def _batches(L):
    g = torch.Generator().manual_seed(5)
    out = []
    for j in range(M):
        tokens = torch.randint(0, V - 1, (MBS, L), generator=g)
        loss_mask = torch.ones_like(tokens)
        loss_mask[0, : 2 + j] = 0
        out.append(dict(tokens=tokens, loss_mask=loss_mask, sample_index=torch.arange(j * MBS, (j + 1) * MBS)))
    return out


# ---- the two families: config, model of a stage, weights ---------------------------------------
def _dg(stage, pp=1, ep=1):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model
    from megatron_csbp.model.diffusiongemma.tiny import tiny_megatron_config

    model_parallel_cuda_manual_seed(5)
    config = tiny_megatron_config(sliding_window=3, params_dtype=EXACT_DTYPE, pipeline_model_parallel_size=pp,
                                  pipeline_dtype=EXACT_DTYPE, expert_model_parallel_size=ep,
                                  calculate_per_token_loss=True)
    return diffusion_gemma_model(config, V, 64, stage=stage), "token_causal", 16, MOE_TOL


def _hybrid(stage, pp=1, ep=1):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.model import builder
    from megatron_csbp.model.hybrid import hybrid_block_spec
    from megatron_csbp.parallel.pipeline import stage_block_spec
    from tests.gdn_helpers import gdn_config

    config = gdn_config(num_layers=len(PATTERN), dtype=EXACT_DTYPE, pipeline_model_parallel_size=pp,
                        pipeline_dtype=EXACT_DTYPE, calculate_per_token_loss=True)
    model_parallel_cuda_manual_seed(5)
    spec = stage_block_spec(hybrid_block_spec(list(PATTERN)), config, stage)
    gpt = builder.gpt_model(config, spec, vocab_size=V, max_sequence_length=32, position_embedding_type="rope",
                            share_embeddings_and_output_weights=False, **stage.kwargs())
    return gpt.to(EXACT_DTYPE), "block_causal", 32, FP64_TOL


FAMILIES = {"diffusion_gemma": _dg, "hybrid": _hybrid}


def _redraw(family, gpt):
    if family == "diffusion_gemma":
        from megatron_csbp.model.diffusiongemma.tiny import redraw_weights

        redraw_weights(gpt, seed=0)
    else:
        from tests.gdn_helpers import randomize_gdn

        torch.manual_seed(0)
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                if "norm" not in name:
                    p.copy_(0.2 * torch.randn(p.shape, dtype=p.dtype))
        for i, layer in enumerate(gpt.decoder.layers):
            if PATTERN[i]:
                randomize_gdn(layer.self_attention, 10 + i)


def _global(name: str, offset: int, ep_rank: int, local_experts: int) -> str:
    name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep_rank * local_experts + int(m.group(1))}.",
                  name)


def _bdlm(gpt, layout_kind, L, cp=1, bp=1):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel

    layout = SequenceLayout(BlockGeometry(L, B, layout_kind), cp, bp)
    return BlockDiffusionModel(gpt, _objective(), layout, bps.get_shard_rank(), bps.get_clean_ring_group())


def pp2_csbp_loss(gpt, kind, L, data, den):
    """One forward and backward of this rank's PP 2 x CSBP (CP 2 + BP 2) stage `gpt` over `data` through
    megatron-core's DDP and pipeline schedule; the loss summed over the shard and pipeline groups (the
    gradients are left in each parameter's `main_grad`). Shared by tests/test_lora_layouts.py."""
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_csbp.parallel import pipeline
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.training.model import TrainableBDLM

    config = gpt.config
    config.finalize_model_grads_func = lambda chunks, num_tokens=None, **kw: finalize_model_grads(chunks, None, **kw)
    chunk = TrainableBDLM(config, _bdlm(gpt, kind, L, 2, 2))
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=False), chunk)
    config.no_sync_func = ddp.no_sync
    losses = []
    get_forward_backward_func()(forward_step_func=pipeline_forward_step(den, losses), data_iterator=iter(data), model=[ddp],
                                num_microbatches=M, seq_length=pipeline.p2p_seq_length(chunk.bdlm),
                                micro_batch_size=MBS, forward_only=False)
    loss = torch.tensor([sum(losses)], dtype=EXACT_DTYPE)
    dist.all_reduce(loss, group=bps.get_shard_group())
    dist.all_reduce(loss, group=mpu.get_pipeline_model_parallel_group())
    return loss


def _rank(rank, world, family):
    from megatron.core import parallel_state as mpu

    from megatron_csbp.parallel import state as bps
    from megatron_csbp.parallel import pipeline
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()
    build = FAMILIES[family]
    # one rank
    bps.initialize_block_parallel()
    gpt, kind, L, tol = build(pipeline.WHOLE)
    _redraw(family, gpt)
    state = {k: v.clone() for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    model = _bdlm(gpt, kind, L)
    data = _batches(L)
    den = sum(model.objective.denominator(b["loss_mask"]) for b in data).to(EXACT_DTYPE)
    ref_loss, ref_grads = one_rank_reference(model, gpt, data, den)
    bps.destroy_block_parallel()

    # PP 2 x CSBP (EP 2 over the shard group for the MoE family)
    ep = 2 if family == "diffusion_gemma" else 1
    bps.initialize_block_parallel(1, 2, 2, 2, ep)
    (vp,) = pipeline.virtual_stages()
    pre, post = pipeline.stage_of(vp)
    gpt, kind, L, tol = build(pipeline.Stage(pre, post, vp), pp=2, ep=ep)
    config = gpt.config
    offset = pipeline.first_layer(config, vp)
    ep_rank, local = mpu.get_expert_model_parallel_rank(), EXPERTS // ep

    def ref_name(n):
        g = _global(n, offset, ep_rank, local)
        return g if g in state else "embedding.word_embeddings.weight"  # the last stage's tied copy

    gpt.load_state_dict({k: state[ref_name(k)] for k in gpt.state_dict() if not k.endswith("_extra_state")},
                        strict=False)
    loss = pp2_csbp_loss(gpt, kind, L, data, den)
    pairs = [(p.main_grad.detach().clone(), ref_grads[ref_name(n)]) for n, p in gpt.named_parameters()]
    worst, rel_norm = gradient_error(pairs)
    kinds = [getattr(layer.self_attention, "layer_kind", type(layer.self_attention).__name__)
             for layer in gpt.decoder.layers]
    bps.destroy_block_parallel()
    return dict(loss=float(loss), ref_loss=ref_loss, worst=worst, rel_norm=rel_norm, tol=tol, offset=offset,
                kinds=kinds, local_experts=local if ep > 1 else None)


@pytest.mark.slow  # ~1 min a family on an idle 2-core machine
@pytest.mark.parametrize("family", ["diffusion_gemma", "hybrid"])
def test_family_pp2_csbp_matches_one_rank(family):
    results = run_distributed(_rank, 4, family)
    for rank, r in enumerate(results):
        print(family, rank, {k: v for k, v in r.items() if k != "tol"})
        check_close(r["loss"], r["ref_loss"], r["worst"], r["rel_norm"], r["tol"], (family, rank))
    # the layer pattern split across the two stages: each holds half of it
    assert {r["offset"] for r in results} == {0, 2}
    assert all(len(r["kinds"]) == 2 for r in results)
