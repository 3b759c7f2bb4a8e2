"""DiffusionGemma's native SFT with self-conditioning under pipeline parallelism
(megatron_csbp/parallel/self_conditioning.py): the first pass through megatron-core's forward-only
schedule, the last stage's hidden states of the noisy rows [noisy rows, b, h] sent to the first
stage (which makes the logits and soft embeddings with its tied embeddings), then the 1F1B training
schedule give the loss and every parameter gradient of one rank, the tied embeddings' gradient
through the soft embeddings included (float64; MOE_TOL for the fp32 router softmax,
tests/gradients.py), with 4 micro-batches (more than the 2 stages). Before this, PP refused
self-conditioning; sending the soft embeddings instead lost ~10% of the gradient norm.

Self-conditioning probability 0.5: the sample indices are chosen so that micro-batch 0 has one
sample that draws it and one that does not (the per-sample mask, also micro-batch 3), micro-batch 1
draws none (no first pass, nothing sent: the bytes are counted) and micro-batch 2 draws it for both;
under interleaving the three picked micro-batches are padded with micro-batch 1 to a multiple of P.
Probability 1.0: every micro-batch. Each rank computes the one-rank reference in-process first
(the micro-batches one after the other), then its stage's chunk with the weights copied in by
global name.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.gradients import (EXACT_DTYPE, MOE_TOL, check_close, gradient_error, one_rank_reference,
                             pipeline_forward_step)

pytestmark = pytest.mark.exactness

V, B, L, MBS, M, SEED, ENC_W = 96, 4, 32, 2, 4, 5, 0.7
#: per micro-batch, which of its 2 samples draw self-conditioning at probability 0.5
DRAWS = [(True, False), (False, False), (True, True), (False, True)]


def _drawing():
    return [j for j, d in enumerate(DRAWS) if any(d)]


def _objective(prob):
    from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective

    return DiffusionGemmaSFTObjective(B, V, seed=SEED, encoder_loss_weight=ENC_W, self_conditioning_prob=prob)


def _batches(prob):
    """M micro-batches of SFT samples (responses start on a block boundary, first response blocks
    differ), sample indices drawn to match DRAWS at probability 0.5 (all draw at 1.0)."""
    obj = _objective(0.5)
    pool = {True: [], False: []}
    i = 0
    while len(pool[True]) < 4 or len(pool[False]) < 4:
        z = torch.zeros(1, L, dtype=torch.long)
        pool[bool(obj.noise(z, torch.ones_like(z), torch.tensor([i])).self_conditioning[0])].append(i)
        i += 1
    g = torch.Generator().manual_seed(9)
    out = []
    for j, draws in enumerate(DRAWS):
        tokens = torch.randint(1, V, (MBS, L), generator=g)
        loss_mask = torch.zeros_like(tokens)
        for e in range(MBS):
            loss_mask[e, (1 + (j + e) % 3) * B: L - 2 * e] = 1
        index = torch.tensor([pool[d].pop(0) for d in draws])
        out.append(dict(tokens=tokens, loss_mask=loss_mask, sample_index=index))
    check = _objective(prob)
    for b, draws in zip(out, DRAWS):
        got = check.noise(b["tokens"], b["loss_mask"], b["sample_index"]).self_conditioning.tolist()
        assert got == ([True] * MBS if prob == 1.0 else list(draws)), got
    return out


def _gpt(stage, **pp):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model
    from megatron_csbp.model.diffusiongemma.tiny import tiny_megatron_config

    model_parallel_cuda_manual_seed(5)
    config = tiny_megatron_config(sliding_window=3, params_dtype=EXACT_DTYPE, pipeline_dtype=EXACT_DTYPE,
                                  calculate_per_token_loss=True, **pp)
    return diffusion_gemma_model(config, V, 64, stage=stage)


def _model(gpt, prob, cp=1, bp=1):
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.diffusiongemma.sft import DiffusionGemmaSFTModel

    layout = SequenceLayout(BlockGeometry(L, B, "token_causal"), cp, bp)
    sharded = cp * bp > 1
    return DiffusionGemmaSFTModel(gpt, _objective(prob), layout, shard_rank=bps.get_shard_rank() if sharded else 0,
                                  ring_group=bps.get_clean_ring_group() if sharded else None)


def _global(name: str, offset: int) -> str:
    return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _rank(rank, world, cases):
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_csbp.parallel import state as bps
    from megatron_csbp.parallel import pipeline
    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.model.diffusiongemma.tiny import redraw_weights
    from megatron_csbp.parallel.self_conditioning import SelfConditioningRelay
    from megatron_csbp.training.model import TrainableBDLM

    install_cpu_compat()
    results = []
    for prob, cp, bp, vp in cases:
        data = _batches(prob)
        # one rank
        bps.initialize_block_parallel()
        gpt = _gpt(pipeline.WHOLE)
        redraw_weights(gpt, seed=0)
        state = {k: v.clone() for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
        model = _model(gpt, prob)
        den = sum(model.objective.denominator(b["loss_mask"]) for b in data).to(EXACT_DTYPE)
        ref_loss, ref_grads = one_rank_reference(model, gpt, data, den)
        bps.destroy_block_parallel()

        # PP 2 (x CP / BP, x VP)
        bps.initialize_block_parallel(1, 2, cp, bp, virtual_pipeline_model_parallel_size=vp)
        pp = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vp)
        if vp:
            pp.update(overlap_p2p_comm=True, batch_p2p_comm=False)
        chunks, names = [], []
        for v in pipeline.virtual_stages():
            pre, post = pipeline.stage_of(v)
            g = _gpt(pipeline.Stage(pre, post, v), **pp)
            offset = pipeline.first_layer(g.config, v)

            def ref_name(n, offset=offset):
                k = _global(n, offset)
                return k if k in state else "embedding.word_embeddings.weight"  # the last stage's tied copy

            g.load_state_dict({k: state[ref_name(k)] for k in g.state_dict() if not k.endswith("_extra_state")},
                              strict=False)
            g.config.finalize_model_grads_func = \
                lambda ch, num_tokens=None, **kw: finalize_model_grads(ch, None, **kw)
            chunks.append(TrainableBDLM(g.config, _model(g, prob, cp, bp)))
            names.append(ref_name)
        ddps = [DistributedDataParallel(c.config, DistributedDataParallelConfig(grad_reduce_in_fp32=False), c,
                                        disable_bucketing=i > 0) for i, c in enumerate(chunks)]
        no_sync = ddps[0].no_sync if len(ddps) == 1 else [d.no_sync for d in ddps]
        for c in chunks:
            c.config.no_sync_func = no_sync
            # canvas plans: rows vary per micro-batch (set after the config's checks, as the trainer does)
            c.config.variable_seq_lengths = pipeline.variable_rows(c.bdlm.objective)
        fb = get_forward_backward_func()
        seq_length = pipeline.p2p_seq_length(chunks[0].bdlm)
        relay = SelfConditioningRelay(chunks, ddps)
        relay.run(fb, data, seq_length, MBS)
        picked = [j for j, b in enumerate(data) if "self_conditioning" in b]
        # what the last stage must send: per drawing micro-batch a 4-integer header and its noisy
        # rows' hidden states [noisy rows, b, h] in float64 (never [.., vocab])
        last = chunks[-1].bdlm
        expect = sum(32 + last._rows_of(b["tokens"], b["loss_mask"], b["sample_index"], None)[3].num_noisy
                     * MBS * last.gpt.config.hidden_size * 8
                     for j, b in enumerate(data) if j in (range(M) if prob == 1.0 or vp else _drawing()))
        losses = []
        its = iter(data) if len(ddps) == 1 else [iter(data) for _ in ddps]
        fb(forward_step_func=pipeline_forward_step(den, losses), data_iterator=its, model=ddps, num_microbatches=M,
           seq_length=seq_length, micro_batch_size=MBS, forward_only=False)
        loss = torch.tensor([sum(losses)], dtype=EXACT_DTYPE)
        dist.all_reduce(loss, group=bps.get_shard_group())
        dist.all_reduce(loss, group=mpu.get_pipeline_model_parallel_group())
        pairs = [(p.main_grad.detach().clone(), ref_grads[name(n)])
                 for c, name in zip(chunks, names) for n, p in c.bdlm.gpt.named_parameters()]
        worst, rel_norm = gradient_error(pairs)
        sc_norm = sum(float(p.main_grad.abs().sum()) for c in chunks for n, p in c.bdlm.gpt.named_parameters()
                      if "self_conditioning" in n)
        results.append(dict(case=(prob, cp, bp, vp), loss=float(loss), ref_loss=ref_loss, worst=worst,
                            rel_norm=rel_norm, picked=picked, sent=relay.sent_bytes,
                            received=relay.received_bytes, expect=expect, first=mpu.is_pipeline_first_stage(ignore_virtual=True),
                            last=mpu.is_pipeline_last_stage(ignore_virtual=True), sc_grad=sc_norm))
        bps.destroy_block_parallel()
    return results


def _check(results):
    for rank, rs in enumerate(results):
        for r in rs:
            print(rank, r)
            check_close(r["loss"], r["ref_loss"], r["worst"], r["rel_norm"], MOE_TOL, (rank, r["case"]))
            prob, _, _, vp = r["case"]
            want = [0, 1, 2, 3] if prob == 1.0 or vp else [0, 2, 3]  # VP pads the picked set to a multiple of P
            assert r["picked"] == (want if r["first"] else []), r
            # only the drawing micro-batches ship [noisy rows, b, h] (float64) + a 3-integer header
            if r["last"]:
                assert r["sent"] == r["expect"] and r["received"] == 0, r
            if r["first"]:
                assert r["received"] > 0 and r["sent"] == 0
                assert r["sc_grad"] > 0  # the self-conditioning MLP is trained on the first stage
    by_case = {}
    for rs in results:
        for r in rs:
            by_case.setdefault(r["case"], []).append(r)
    for rs in by_case.values():
        assert sum(r["sent"] for r in rs) == sum(r["received"] for r in rs)


def test_self_conditioning_pp2_matches_one_rank():
    """PP 2, probability 0.5 (mixed, none, all per micro-batch)."""
    _check(run_distributed(_rank, 2, [(0.5, 1, 1, None)]))


@pytest.mark.slow
def test_self_conditioning_pp2_every_micro_batch_matches_one_rank():
    """PP 2, probability 1.0 (every micro-batch runs the first pass)."""
    _check(run_distributed(_rank, 2, [(1.0, 1, 1, None)]))


@pytest.mark.slow
def test_self_conditioning_pp2_interleaved_matches_one_rank():
    """PP 2 x VP 2 (one layer a chunk): the picked micro-batches padded to a multiple of P."""
    _check(run_distributed(_rank, 2, [(0.5, 1, 1, 2)]))


@pytest.mark.slow
@pytest.mark.parametrize("cp,bp", [(2, 1), (1, 2), (2, 2)])
def test_self_conditioning_pp2_with_shard_group_matches_one_rank(cp, bp):
    """PP 2 x CP 2, PP 2 x BP 2, PP 2 x CSBP (CP 2 + BP 2: a 2-rank shard group): 4 ranks each."""
    _check(run_distributed(_rank, 2 * max(cp, bp), [(0.5, cp, bp, None)]))
