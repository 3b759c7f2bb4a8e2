"""Model-level exactness: a tiny megatron-core GPTModel trained as a BDLM gives the same loss and
the same parameter gradients on 1 rank and under CP, BP, CSBP and TP x CSBP, in float64 (the error
model and tolerances are tests/gradients.py's FP64_TOL).

Each spawned rank first computes the single-device reference in-process (Megatron initialised
with TP = 1 and no sequence parallelism: every rank is a data-parallel replica, no collective
touches the attention), then the same weights under the layout being tested. Under TP the
reference weights are sliced along Megatron's partition dimension.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.gradients import EXACT_DTYPE, FP64_TOL

pytestmark = pytest.mark.exactness

L, B, VOCAB, BATCH = 32, 4, 64, 2


def build_gpt(sequence_parallel=False, recompute=False, tp=1, seed=1234):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_csbp.model.spec import with_block_diffusion_attention

    extra = {}
    if recompute:
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel, normalization="RMSNorm",
        params_dtype=EXACT_DTYPE, **extra,
    )
    # Megatron's TP code forks named RNG states (CPU generator under the compat shim).
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    gpt = GPTModel(config, with_block_diffusion_attention(get_gpt_layer_local_spec(normalization="RMSNorm")),
                   vocab_size=VOCAB, max_sequence_length=L, position_embedding_type="rope",
                   share_embeddings_and_output_weights=False)
    # Megatron's torch-norm fallback (no Apex) builds its weights in fp32 whatever params_dtype says.
    return gpt.to(EXACT_DTYPE)


def batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB - 1, (BATCH, L), generator=g)
    loss_mask = torch.ones_like(tokens)
    loss_mask[0, :6] = 0  # an SFT prompt: never noised, never a target
    return tokens, loss_mask, torch.tensor([11, 42])


def objective():
    from megatron_csbp.objectives import BD3LMObjective

    return BD3LMObjective(B, mask_token_id=VOCAB - 1, seed=3)


def run_layout(gpt, c):
    """Loss of `batch()` under case `c`'s layout (backward run); `c` may name a `run` of its own
    (module:function, the same signature; tests/test_packing_layouts.py)."""
    if c.get("run"):
        import importlib

        module, fn = c["run"].split(":")
        return getattr(importlib.import_module(module), fn)(gpt, c)
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel

    layout = SequenceLayout(BlockGeometry(L, B, c["clean_attention"]), c["cp"], c["bp"], c["schedule"])
    model = BlockDiffusionModel(gpt, objective(), layout, bps.get_shard_rank(),
                                bps.get_clean_ring_group(), c["transport"])
    tokens, loss_mask, index = batch()
    out = model(tokens, loss_mask, index)
    out.loss.backward()
    return out.loss.detach()


def _reference(c):
    """One rank's loss, weights and gradients of case `c`'s run (its objective, its data)."""
    from megatron_csbp.parallel import state as bps

    bps.initialize_block_parallel()
    gpt = build_gpt()
    loss = run_layout(gpt, dict(c, cp=1, bp=1, tp=1, sp=False, recompute=False, transport="allgather",
                                schedule="mirrored"))
    state = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    grads = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    bps.destroy_block_parallel()
    return loss, state, grads


def _tp_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int) -> torch.Tensor:
    if full.shape == param.shape:
        return full
    dim = param.partition_dim
    size = param.shape[dim]
    return full.narrow(dim, tp_rank * size, size)


def _model_rank(rank, world, cases):
    from megatron.core import parallel_state as mpu

    from megatron_csbp.parallel import state as bps
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()  # recompute replays Megatron's RNG states, which name CUDA

    out = []
    for case in cases:
        ref_loss, ref_state, ref_grads = _reference(case)
        bps.initialize_block_parallel(tensor_model_parallel_size=case["tp"], context_parallel_size=case["cp"],
                                      block_parallel_size=case["bp"])
        gpt = build_gpt(sequence_parallel=case["sp"], recompute=case["recompute"], tp=case["tp"])
        tp_rank = mpu.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for n, p in gpt.named_parameters():
                p.copy_(_tp_slice(ref_state[n], p, tp_rank))
        loss = run_layout(gpt, case)
        shard_group = bps.get_shard_group()
        dist.all_reduce(loss, group=shard_group)  # each rank holds the partial loss of its blocks
        errors = {}
        for n, p in gpt.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g, group=shard_group)  # gradients are summed over the shard group
            if case["sp"] and getattr(p, "sequence_parallel", False):
                dist.all_reduce(g, group=mpu.get_tensor_model_parallel_group())
            ref = _tp_slice(ref_grads[n], p, tp_rank)
            errors[n] = float((g - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        out.append(dict(loss=float(loss), ref_loss=float(ref_loss), errors=errors))
        bps.destroy_block_parallel()
    return out


def case(cp=1, bp=1, tp=1, transport="allgather", schedule="mirrored", sp=False, recompute=False,
         clean_attention="block_causal"):
    return dict(cp=cp, bp=bp, tp=tp, transport=transport, schedule=schedule, sp=sp, recompute=recompute,
                clean_attention=clean_attention)


WORLD_CASES = {
    2: [
        case(cp=2),
        case(cp=2, transport="ring", clean_attention="token_causal"),
        case(bp=2),
        case(cp=2, bp=2),
        case(cp=2, bp=2, transport="ring"),
        case(cp=2, bp=2, schedule="contiguous"),
        case(cp=2, bp=2, recompute=True),
    ],
    4: [
        case(cp=2, bp=4),
        case(cp=4, bp=4, clean_attention="token_causal"),
        case(tp=2, cp=2, bp=2),
        case(tp=2, cp=2, bp=2, sp=True),
        case(tp=2, cp=2, bp=2, transport="ring", recompute=True),
    ],
}


# The 4-rank world is in the slow set (suite budget, docs/testing.md); the 2-rank world runs by default.
@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.slow) if w == 4 else w for w in sorted(WORLD_CASES)])
def test_model_loss_and_grads_match_single_rank(world):
    check_against_single_rank(WORLD_CASES[world], world)


def check_against_single_rank(cases, world):
    """Run `cases` on `world` ranks; each rank's loss and gradients against one rank's (FP64_TOL)."""
    results = run_distributed(_model_rank, world, cases)
    for i, c in enumerate(cases):
        for rank, per_rank in enumerate(results):
            r = per_rank[i]
            worst = max(r["errors"].items(), key=lambda kv: kv[1])
            if rank == 0:
                print(f"{c}: loss |diff|/|l1| {abs(r['loss'] - r['ref_loss']) / abs(r['ref_loss']):.1e}, "
                      f"worst per-parameter max|g - g1|/max|g1| {worst[1]:.1e} ({worst[0]})")
            assert abs(r["loss"] - r["ref_loss"]) <= FP64_TOL["loss"] * abs(r["ref_loss"]), (c, rank, r["loss"], r["ref_loss"])
            assert worst[1] <= FP64_TOL["worst"], (c, rank, worst)
