"""DiffusionGemma with expert parallelism (EP = 2, gloo, CPU shim) equals one rank.

The reference runs both samples of a batch on one rank (EP = 1) through the `diffusiongemma-sft`
training forward (self-conditioning on one sample, AR loss on). Under EP = 2 each rank takes one
sample (the EP ranks are data-parallel for the dense weights), holds half the experts, and divides
by the global denominator. Sum of the two rank losses = reference loss; dense gradients summed over
the ranks = reference; each rank's expert gradients = the reference's for those experts.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.distributed import run_distributed
from tests.gradients import EXACT_DTYPE, MOE_TOL

torch.set_num_threads(1)

V, L, B, E = 96, 16, 4, 4


def _config(**kw):
    from megatron_csbp.model.diffusiongemma.tiny import tiny_megatron_config

    return tiny_megatron_config(sliding_window=3, params_dtype=EXACT_DTYPE, **kw)


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (2, L), generator=g)
    loss_mask = torch.zeros(2, L, dtype=torch.long)
    loss_mask[0, 4:14] = 1
    loss_mask[1, 8:] = 1
    return tokens, loss_mask, torch.tensor([2, 3])  # sample 2 draws self-conditioning, sample 3 not (antithetic times)


def _model(config):
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model
    from megatron_csbp.model.diffusiongemma.sft import DiffusionGemmaSFTModel
    from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective

    gpt = diffusion_gemma_model(config, V, 64)
    obj = DiffusionGemmaSFTObjective(B, V, seed=7, encoder_loss_weight=0.5)
    return gpt, DiffusionGemmaSFTModel(gpt, obj, SequenceLayout(BlockGeometry(L, B, "token_causal")))


def _expert_key(key: str, rank: int, local: int):
    """Global name of a local expert parameter of `rank`."""
    marker = "local_experts."
    if marker not in key:
        return key
    head, tail = key.split(marker)
    j, rest = tail.split(".", 1)
    return f"{head}{marker}{rank * local + int(j)}.{rest}"


def _ep_rank(rank, world_size, state_path, dispatcher):
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(expert_model_parallel_size=2)
    config = _config(expert_model_parallel_size=2, moe_token_dispatcher_type=dispatcher)
    gpt, model = _model(config)
    full = torch.load(state_path)
    local = E // 2
    gpt.load_state_dict({k: full[_expert_key(k, rank, local)] for k in gpt.state_dict() if not k.endswith("_extra_state")},
                        strict=False)
    model.train()
    tokens, loss_mask, index = _batch()
    denominator = model.objective.denominator(loss_mask)  # global: both samples
    out = model(tokens[rank : rank + 1], loss_mask[rank : rank + 1], index[rank : rank + 1], denominator)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    grads = {}
    for name, p in gpt.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        if "local_experts." not in name:
            dist.all_reduce(g)  # dense weights: data-parallel over the EP ranks
        grads[_expert_key(name, rank, local)] = g
    return dict(loss=loss.item(), grads=grads)


@pytest.fixture(scope="module")
def reference(megatron_single_rank):
    gpt, model = _model(_config())
    from megatron_csbp.model.diffusiongemma.tiny import redraw_weights

    redraw_weights(gpt, seed=0)  # random everywhere, norms and scales near 1, distinct layer scalars
    model.train()
    tokens, loss_mask, index = _batch()
    nb = model.objective.noise(tokens, loss_mask, index)
    assert nb.self_conditioning.tolist() == [True, False]
    out = model(tokens, loss_mask, index)
    out.loss.backward()
    grads = {k: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for k, p in gpt.named_parameters()}
    path = os.path.join(tempfile.mkdtemp(), "state.pt")
    torch.save({k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}, path)
    return dict(loss=out.loss.item(), grads=grads, path=path)


@pytest.mark.exactness
@pytest.mark.parametrize("dispatcher", ["alltoall", pytest.param("allgather", marks=pytest.mark.slow)])
def test_ep2_equals_one_rank(reference, dispatcher):
    results = run_distributed(_ep_rank, 2, reference["path"], dispatcher)
    for r, res in enumerate(results):
        # float64 except Megatron's fp32 router softmax: tests/gradients.py (MOE_TOL).
        assert abs(res["loss"] - reference["loss"]) <= MOE_TOL["loss"] * max(1.0, abs(reference["loss"])), r
        worst = 0.0
        for name, ref in reference["grads"].items():
            if "local_experts." in name and name not in res["grads"]:
                continue
            got = res["grads"][name]
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item())
        print(f"{dispatcher} rank {r}: loss {res['loss']:.12f} (ref {reference['loss']:.12f}), worst rel grad diff {worst:.2e}")
        assert worst <= MOE_TOL["worst"]
    experts = {n for res in results for n in res["grads"] if "local_experts." in n}
    assert experts == {n for n in reference["grads"] if "local_experts." in n}
