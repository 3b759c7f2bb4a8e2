"""Pipeline parallelism is exact: the trainer's model chunks (megatron_csbp/parallel/pipeline.py) run through
megatron-core's pipeline schedules (1F1B; interleaved with virtual stages) with Megatron's DDP and
`finalize_model_grads` give the loss and every parameter gradient of one rank, in float64 (error
model and tolerances: tests/gradients.py's FP64_TOL), under PP 2 alone and PP 2 x CP 2 / BP 2 /
CSBP, with more micro-batches than stages so the schedule really pipelines.

Each spawned rank first computes the reference in-process (Megatron at PP = TP = 1, every rank a
data-parallel replica, the micro-batches run one after the other on the whole model built by
`build_model`), then the pipelined chunks built by `build_model_chunks` from the same seed: their
initial weights must equal one rank's (a chunk replays the draws before its first layer). Tied
embeddings: the last stage's copy of the word embeddings gets the summed gradient by
megatron-core's embedding-group all-reduce, so it is compared with one rank's embedding gradient.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.gradients import (EXACT_DTYPE, FP64_TOL, MOE_TOL, check_close, gradient_error, one_rank_reference,
                             pipeline_forward_step, tp_slice)

pytestmark = pytest.mark.exactness

L, B, VOCAB, MBS, M = 32, 8, 64, 2, 4  # M micro-batches of MBS samples per iteration (M > PP)


# A flag-built MoE with dense and MoE layers mixed (--moe-layer-freq "([1,0,1,0])"): under PP each
# chunk builds its layers' entries of the pattern and draws its weights by their global names.
MIXED_MOE = dict(num_experts=4, moe_router_topk=2, moe_layer_freq=[1, 0, 1, 0])


def model_args(num_layers=2, tp=1, cp=1, bp=1, sp=False, pp=1, vp=None, first=None, last=None, tied=True, moe=False):
    from megatron_csbp.training.model import ModelArgs

    return ModelArgs(num_layers=num_layers, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                     num_query_groups=2, seq_length=L, vocab_size=VOCAB, block_size=B, mask_token_id=VOCAB - 1,
                     tensor_model_parallel_size=tp, context_parallel_size=cp, block_parallel_size=bp,
                     sequence_parallel=sp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                     decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
                     untie_embeddings_and_output_weights=not tied, attention_kernel="tiled",
                     **(MIXED_MOE if moe else {}))


def batches():
    g = torch.Generator().manual_seed(5)
    out = []
    for j in range(M):
        tokens = torch.randint(0, VOCAB - 1, (MBS, L), generator=g)
        loss_mask = torch.ones_like(tokens)
        loss_mask[0, : 3 + j] = 0  # an SFT prompt
        out.append(dict(tokens=tokens, loss_mask=loss_mask, sample_index=torch.arange(j * MBS, (j + 1) * MBS)))
    return out


def _fp64(build):
    """Build in float64: the CPU draws are fp32 either way (then cast), so weights match."""
    from megatron_csbp.model import assemble as model_mod

    orig = model_mod.params_dtype
    model_mod.params_dtype = lambda a: EXACT_DTYPE
    try:
        return build()
    finally:
        model_mod.params_dtype = orig


def _global_name(name: str, offset: int) -> str:
    return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _reference(a):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.training.model import build_model

    bps.initialize_block_parallel()
    model = _fp64(lambda: build_model(a)).to(EXACT_DTYPE)
    data = batches()
    den = sum(model.bdlm.objective.denominator(b["loss_mask"]) for b in data).to(EXACT_DTYPE)
    loss, grads = one_rank_reference(model, model.gpt, data, den)
    assert all(p.grad is not None for p in model.gpt.parameters()), "a parameter got no gradient"
    state = {n: p.detach().clone() for n, p in model.gpt.named_parameters()}
    bps.destroy_block_parallel()
    return loss, grads, state


def _pipelined(a, ref_grads, ref_state):
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_csbp.parallel import state as bps
    from megatron_csbp.parallel import pipeline
    from megatron_csbp.training.model import build_model_chunks

    bps.initialize_block_parallel(a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                                  a.context_parallel_size, a.block_parallel_size,
                                  virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size)

    def finalize(chunks, num_tokens=None, **kw):
        return finalize_model_grads(chunks, None, **kw)

    chunks = [c.to(EXACT_DTYPE) for c in _fp64(lambda: build_model_chunks(a, finalize_model_grads_func=finalize))]
    ddps = [DistributedDataParallel(c.config, DistributedDataParallelConfig(grad_reduce_in_fp32=False), c,
                                    disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    for c in chunks:
        c.config.no_sync_func = ddps[0].no_sync if len(ddps) == 1 else [d.no_sync for d in ddps]
    tp_rank = mpu.get_tensor_model_parallel_rank()
    init_err = 0.0
    for c in chunks:  # initial weights: one rank's
        offset = pipeline.first_layer(c.config, c.gpt.vp_stage)
        for n, p in c.gpt.named_parameters():
            ref_name = _global_name(n, offset)
            if ref_name not in ref_state:  # the last stage's copy of tied embeddings
                ref_name = "embedding.word_embeddings.weight"
            ref = tp_slice(ref_state[ref_name], p, tp_rank)
            init_err = max(init_err, float((p.detach() - ref).abs().max()))
    data = batches()
    den = sum(chunks[0].bdlm.objective.denominator(b["loss_mask"]) for b in data).to(EXACT_DTYPE)
    losses = []
    get_forward_backward_func()(
        forward_step_func=pipeline_forward_step(den, losses), data_iterator=[iter(data) for _ in ddps] if len(ddps) > 1 else iter(data),
        model=ddps, num_microbatches=M, seq_length=pipeline.p2p_seq_length(chunks[0].bdlm),
        micro_batch_size=MBS, forward_only=False)
    loss = torch.tensor([sum(losses)], dtype=EXACT_DTYPE)
    dist.all_reduce(loss, group=bps.get_shard_group())
    dist.all_reduce(loss, group=mpu.get_pipeline_model_parallel_group())
    pairs = []
    for c in chunks:
        offset = pipeline.first_layer(c.config, c.gpt.vp_stage)
        for n, p in c.gpt.named_parameters():
            ref_name = _global_name(n, offset)
            if ref_name not in ref_grads:
                ref_name = "embedding.word_embeddings.weight"
            pairs.append((p.main_grad.detach().clone(), tp_slice(ref_grads[ref_name], p, tp_rank)))
    bps.destroy_block_parallel()
    worst, rel_norm = gradient_error(pairs)
    return float(loss), worst, rel_norm, init_err


def _rank(rank, world, cases):
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()
    out = []
    for kw in cases:
        a = model_args(**kw)
        ref_loss, ref_grads, ref_state = _reference(model_args(num_layers=a.num_layers, tied=kw.get("tied", True),
                                                               moe=kw.get("moe", False)))
        loss, worst, rel_norm, init_err = _pipelined(a, ref_grads, ref_state)
        out.append(dict(case=kw, loss=loss, ref_loss=ref_loss, worst=worst, rel_norm=rel_norm, init_err=init_err))
    return out


def _check(world, cases):
    for per_rank in run_distributed(_rank, world, cases):
        for r in per_rank:
            print(r)
            assert r["init_err"] == 0.0, r  # the same draws, cast the same way
            tol = MOE_TOL if r["case"].get("moe") else FP64_TOL  # the router's fp32 softmax (tests/gradients.py)
            check_close(r["loss"], r["ref_loss"], r["worst"], r["rel_norm"], tol, r["case"])


def test_pp2_interleaved_and_uneven_match_one_rank():
    # the mixed dense/MoE case also checks the last stage's tied copy is drawn as the embedding (init_err 0)
    _check(2, [dict(pp=2), dict(pp=2, num_layers=4, vp=2, tied=False), dict(pp=2, num_layers=3, first=2),
               dict(pp=2, num_layers=4, vp=2, moe=True)])


def test_pp2_csbp_matches_one_rank():
    _check(4, [dict(pp=2, cp=2, bp=2)])


@pytest.mark.slow
def test_pp2_cp_bp_and_interleaved_csbp_match_one_rank():
    _check(4, [dict(pp=2, cp=2), dict(pp=2, bp=2), dict(pp=2, cp=2, bp=2, num_layers=4, vp=2)])


@pytest.mark.slow
def test_pp2_tp2_csbp_sequence_parallel_eight_ranks():
    _check(8, [dict(pp=2, tp=2, cp=2, bp=2, sp=True), dict(pp=2, tp=2, cp=2, bp=2, num_layers=4, vp=2)])
