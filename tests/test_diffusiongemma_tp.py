"""DiffusionGemma under tensor parallelism (TP = 2 with sequence parallelism, gloo, CPU shim)
equals one rank: noisy logits with self-conditioning, and gradients of a weighted sum of them.

Covers the TP paths the model adds: full layers with fewer KV heads (1) than TP ranks (K=V split
after Megatron's all-gather), the vocabulary-parallel self-conditioning softmax and soft
embedding, sequence-parallel embedding / canvas norm / layer scalars on shard-major rows, and the
MoE block (experts tensor-parallel, branch norms sequence-parallel).
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.distributed import run_distributed
from tests.gradients import EXACT_DTYPE, MOE_TOL

torch.set_num_threads(1)

V, L, B, TP = 96, 16, 4, 2


def _config(**kw):
    from megatron_csbp.model.diffusiongemma.tiny import tiny_megatron_config

    return tiny_megatron_config(sliding_window=3, params_dtype=EXACT_DTYPE, **kw)


def _inputs():
    g = torch.Generator().manual_seed(4)
    clean = torch.randint(0, V, (2, L), generator=g)
    noisy = torch.randint(0, V, (2, L), generator=g)
    clean[1, 5] = 0
    sc = (3 * torch.randn(2, L, V, generator=g)).to(EXACT_DTYPE)
    weight = torch.randn(2, L, V, generator=g).to(EXACT_DTYPE)
    return clean, noisy, sc, weight


def _forward(gpt, vocab_slice=slice(None)):
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.bdlm import BlockDiffusionModel
    from megatron_csbp.objectives import BD3LMObjective

    bdm = BlockDiffusionModel(gpt, BD3LMObjective(B, V - 1), SequenceLayout(BlockGeometry(L, B, "token_causal")))
    clean, noisy, sc, weight = _inputs()
    rows = bdm.plan.local
    ids = torch.where(rows.is_clean[None], clean[:, rows.position], noisy[:, rows.position])
    noisy_pos = rows.position[~rows.is_clean]
    with gpt.self_conditioning_inputs(sc[:, noisy_pos][..., vocab_slice], torch.tensor([True, False])):
        logits = bdm.logits(ids)
    (logits * weight[:, noisy_pos][..., vocab_slice]).sum().backward()
    return logits.detach()


def _shard(key, full, rank):
    """This TP rank's piece of a full (TP = 1) tensor, as Megatron's parallel linears hold it."""
    if key.endswith("linear_fc1.weight"):  # gated: [gate ; up], each split over ranks
        return torch.cat([part.chunk(TP, dim=0)[rank] for part in full.chunk(2, dim=0)])
    if key.endswith("linear_qkv.weight") or key == "embedding.word_embeddings.weight":
        return full.chunk(TP, dim=0)[rank]
    if key.endswith("linear_proj.weight") or key.endswith("linear_fc2.weight"):
        return full.chunk(TP, dim=1)[rank]
    return full


def _tp_rank(rank, world_size, state_path):
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model

    from megatron.core import tensor_parallel

    mpu.initialize_model_parallel(tensor_model_parallel_size=TP)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    gpt = diffusion_gemma_model(_config(tensor_model_parallel_size=TP, sequence_parallel=True), V, 64)
    full = torch.load(state_path)
    gpt.load_state_dict({k: _shard(k, full[k], rank) for k in gpt.state_dict() if not k.endswith("_extra_state")},
                        strict=False)
    gpt.train()
    logits = _forward(gpt, slice(rank * V // TP, (rank + 1) * V // TP))
    grads = {}
    for name, p in gpt.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        if getattr(p, "sequence_parallel", False):  # replicated weight fed by this rank's rows/heads only
            dist.all_reduce(g, group=mpu.get_tensor_model_parallel_group())
        grads[name] = g
    return dict(logits=logits, grads=grads)


@pytest.fixture(scope="module")
def reference(megatron_single_rank):
    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model

    gpt = diffusion_gemma_model(_config(), V, 64)
    from megatron_csbp.model.diffusiongemma.tiny import redraw_weights

    redraw_weights(gpt, seed=0)  # random everywhere, norms and scales near 1, distinct layer scalars
    gpt.train()
    logits = _forward(gpt)
    grads = {k: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for k, p in gpt.named_parameters()}
    path = os.path.join(tempfile.mkdtemp(), "state.pt")
    torch.save({k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}, path)
    return dict(logits=logits, grads=grads, path=path)


@pytest.mark.exactness
def test_tp2_sequence_parallel_equals_one_rank(reference):
    results = run_distributed(_tp_rank, TP, reference["path"])
    logits = torch.cat([r["logits"] for r in results], dim=-1)
    diff = (logits - reference["logits"]).abs().max().item()
    worst = 0.0
    for name, ref in reference["grads"].items():
        for rank, res in enumerate(results):
            worst = max(worst, ((res["grads"][name] - _shard(name, ref, rank)).abs().max()
                                / ref.abs().max().clamp_min(1e-6)).item())
    print(f"TP=2+SP: max |logit diff| {diff:.2e}, worst relative gradient difference {worst:.2e}")
    # float64 except Megatron's fp32 router softmax: tests/gradients.py (MOE_TOL; logits |l| <= 30).
    assert diff < 30 * MOE_TOL["loss"] and worst < MOE_TOL["worst"]
