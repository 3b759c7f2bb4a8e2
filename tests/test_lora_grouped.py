"""LoRA on grouped experts (megatron-core 0.16's `GroupedMLP`, `--moe-grouped-gemm`; lora/grouped.py) equals
LoRA on sequential experts: the trainer's flag-built MoE with grouped experts and adapters, built from the
same flags and seed, draws the same base weights as the sequential model (by global name, under any
layout) and gives its loss and every adapter gradient in float64 (default tier: EP 2;
slow: one rank, EP 2, expert TP 2 + SP, fc2 only, probabilities on the input), draws the same adapters
from the same seed, and saves the same adapter checkpoint (keys, global shapes, tensors: each model's
checkpoint loads into the other).

Test device: GroupedMLP's GEMMs call the `grouped_gemm` package's `ops.gmm` (a CUDA kernel). The
spawned ranks, and only they, install a `grouped_gemm` module whose `ops.gmm` is the kernel's
definition on CPU (per expert, its rows of the input times its weight), so megatron-core's own
GroupedMLP code runs: its weights, initialisation, activation and sharded state dict, our adapters,
their sharding and checkpoint names. What it does not prove: the CUDA kernel (its numerics, bf16).
GroupedMLP's forward asserts `bf16=True` in the config: the models here set it, their weights stay
float64. docs/lora.md#grouped-experts.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core.transformer.moe.grouped_gemm_util", reason=(
    "megatron-core has no megatron.core.transformer.moe.grouped_gemm_util nor GroupedMLP (0.19: its local spec "
    "builds SequentialMLP for --moe-grouped-gemm, which takes adapters)"))

from tests.distributed import run_distributed  # noqa: E402
from tests.gradients import EXACT_DTYPE, FP64_TOL, check_close, gradient_error, one_rank_reference  # noqa: E402
from tests.test_lora_layouts import MOE, _fp64, batches, model_args  # noqa: E402

pytestmark = pytest.mark.exactness


def _gmm(a, b, batch_sizes, trans_b=False):
    """grouped_gemm's `ops.gmm` by its definition: expert e's `batch_sizes[e]` rows of `a` times b[e]."""
    return torch.cat([x @ (w.t() if trans_b else w) for x, w in zip(torch.split(a, batch_sizes.tolist()), b)])


def _install_cpu_grouped_gemm():
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    module = types.ModuleType("grouped_gemm")
    module.ops = types.SimpleNamespace(gmm=_gmm)
    sys.modules["grouped_gemm"] = module
    gg.grouped_gemm, gg.ops = module, module.ops  # megatron-core looked for it when first imported


def _drawn_differently(grouped, sequential):
    """The base weights the grouped model did not draw as the sequential one did (both built from the same flags
    and seed): GroupedMLP's weight1 / weight2 must hold each local expert's fc1 / fc2 weight transposed
    ([experts, hidden, fc1 rows] and [experts, fc2 columns, hidden] views), every other weight the same tensor."""
    state = sequential.state_dict()
    differ = [n for n, p in grouped.named_parameters() if n in state and not torch.equal(p, state[n])]
    for i, (layer, ref) in enumerate(zip(grouped.decoder.layers, sequential.decoder.layers)):
        mlp, experts = layer.mlp.experts, ref.mlp.experts.local_experts
        for w, fc in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
            expected = torch.stack([getattr(e, fc).weight.t() for e in experts]).reshape(getattr(mlp, w).shape)
            if not torch.equal(getattr(mlp, w), expected):
                differ.append(f"decoder.layers.{i}.mlp.experts.{w}")
    return differ


def _loss_and_grads(model, micro_batches):
    from megatron_csbp.lora import is_adapter

    data = batches()[:micro_batches]
    den = sum(model.bdlm.objective.denominator(b["loss_mask"]) for b in data).to(EXACT_DTYPE)
    loss, every = one_rank_reference(model, model.gpt, data, den)
    assert all(p.grad is not None for n, p in model.gpt.named_parameters() if is_adapter(n)), "an adapter got no gradient"
    return loss, {n: g for n, g in every.items() if is_adapter(n)}


def _saved(model, folder):
    """Save the adapters as a LoRA run does (the model's sharded state, adapter keys only); the keys and
    global shapes of the checkpoint."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_csbp.checkpoint.state import write_results_in_process
    from megatron_csbp.lora import is_adapter

    if dist.get_rank() == 0:
        os.makedirs(folder)
    dist.barrier()
    with write_results_in_process():
        dist_checkpointing.save({k: v for k, v in model.gpt.sharded_state_dict().items() if is_adapter(k)}, folder)
    dist.barrier()
    return {k: tuple(m.size) for k, m in FileSystemReader(folder).read_metadata().state_dict_metadata.items()}


def _loaded_error(model, folder):
    """The largest difference between `model`'s adapters and those the checkpoint `folder` gives it."""
    from megatron.core import dist_checkpointing

    from megatron_csbp.lora import is_adapter

    loaded = dist_checkpointing.load({k: v for k, v in model.gpt.sharded_state_dict().items() if is_adapter(k)},
                                     folder)
    state = model.gpt.state_dict()
    return max(float((loaded[k] - state[k]).abs().max()) for k in loaded)


def _recompute_refusal(config):
    """The one line for --recompute-modules moe_act (the adapters are not in megatron-core's recompute)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_csbp.lora import LoRAConfig
    from megatron_csbp.lora.grouped import LoRAGroupedMLP

    config = dataclasses.replace(config, recompute_granularity="selective", recompute_modules=["moe_act"])
    try:
        LoRAGroupedMLP(2, config, ProcessGroupCollection.use_mpu_process_groups(), lora=LoRAConfig(4))
    except ValueError as exc:
        return str(exc)


def _rank(rank, world, cases, root, micro_batches):
    from megatron.core import parallel_state as mpu

    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.lora import is_adapter
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.training.model import build_model

    install_cpu_compat()
    _install_cpu_grouped_gemm()
    out = []
    for i, case in enumerate(cases):
        rest = dict(case)
        bps.initialize_block_parallel(rest.pop("tp", 1), expert_model_parallel_size=rest.pop("ep", 1))
        a = model_args(tp=case.get("tp", 1), ep=case.get("ep", 1), bf16=True,
                       **dict(MOE, **{k: v for k, v in rest.items() if k != "probs_on_input"}))
        sequential = _fp64(lambda: build_model(a))
        grouped = _fp64(lambda: build_model(dataclasses.replace(a, moe_grouped_gemm=True)))
        for m in (sequential, grouped):  # megatron-core's option (no trainer flag): read by the experts' forward
            m.gpt.config.moe_apply_probs_on_input = rest.get("probs_on_input", False)
        kinds = {type(layer.mlp.experts).__name__ for layer in grouped.gpt.decoder.layers}
        drawn = {n: torch.equal(p, sequential.gpt.state_dict()[n]) for n, p in grouped.gpt.named_parameters()
                 if is_adapter(n)}
        drawn_differently = _drawn_differently(grouped.gpt, sequential.gpt)
        (ref_loss, ref), (loss, got) = (_loss_and_grads(m, micro_batches) for m in (sequential, grouped))
        worst, rel_norm = gradient_error([(got[n], ref[n]) for n in ref])
        keys = [_saved(m, os.path.join(root, f"{i}-{kind}")) for m, kind in ((sequential, "seq"), (grouped, "grp"))]
        crossed = (_loaded_error(sequential, os.path.join(root, f"{i}-grp")),
                   _loaded_error(grouped, os.path.join(root, f"{i}-seq")))
        out.append(dict(case=case, drawn_differently=drawn_differently, expert_tp=mpu.get_expert_tensor_parallel_world_size(), kinds=kinds,
                        names=sorted(got) == sorted(ref), adapters=len(ref),
                        drawn_equal=all(drawn.values()) and len(drawn) == len(ref), loss=loss, ref_loss=ref_loss,
                        worst=worst, rel_norm=rel_norm, same_keys=keys[0] == keys[1], n_keys=len(keys[0]),
                        crossed=crossed, refusal=_recompute_refusal(grouped.gpt.config)))
        bps.destroy_block_parallel()
    return out


def _check(cases, root, micro_batches):
    for per_rank in run_distributed(_rank, 2, cases, root, micro_batches):
        for r, case in zip(per_rank, cases):
            print(r)
            assert r["kinds"] == {"LoRAGroupedMLP"} and r["names"] and r["adapters"] > 0, r
            assert r["expert_tp"] == case.get("tp", 1), r
            assert r["drawn_equal"], r  # the same seed draws the same adapters (by global name)
            assert r["drawn_differently"] == [], r  # and the same base weights: grouped experts by global name too
            check_close(r["loss"], r["ref_loss"], r["worst"], r["rel_norm"], FP64_TOL, r["case"])
            assert r["same_keys"] and r["n_keys"] > 0 and r["crossed"] == (0.0, 0.0), r
            assert r["refusal"] == ("--recompute-modules moe_act with --lora-rank: the grouped experts' adapters are "
                                    "not recomputed; leave moe_act out of --recompute-modules"), r


def test_grouped_experts_equal_sequential_ep2(tmp_path):
    _check([dict(ep=2)], str(tmp_path), micro_batches=1)


@pytest.mark.slow
def test_grouped_experts_equal_sequential_one_rank_ep2_expert_tp2(tmp_path):
    top1 = dict(moe_router_topk=1, moe_router_pre_softmax=True)
    _check([dict(), dict(ep=2), dict(tp=2, sp=True), dict(ep=2, probs_on_input=True, **top1),
            dict(tp=2, sp=True, lora_target_modules=("experts.linear_fc2", "linear_qkv"))], str(tmp_path), 4)


def test_grouped_experts_spec():
    """The local spec's GroupedMLP becomes LoRAGroupedMLP with the targeted fcs; TransformerEngine's
    grouped experts stay refused in one line."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_csbp.lora import LoRAConfig
    from megatron_csbp.lora.grouped import LoRAGroupedMLP
    from megatron_csbp.lora.spec import with_adapters

    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=True)
    for targets, fcs in (((), ("linear_fc1", "linear_fc2")), (("experts.linear_fc2",), ("linear_fc2",))):
        experts = with_adapters(spec, LoRAConfig(4, **dict(target_modules=targets) if targets else {})
                                ).submodules.mlp.submodules.experts
        assert experts.module is LoRAGroupedMLP and experts.params["lora_targets"] == fcs
    untouched = with_adapters(spec, LoRAConfig(4, target_modules=("linear_qkv",))).submodules.mlp.submodules.experts
    assert untouched.module.__name__ == "GroupedMLP"
    with pytest.raises(ValueError, match=r"^--lora-target-modules linear_fc1_gate: grouped experts "
                                         r"\(--moe-grouped-gemm\) take fc1 adapters whole, not per part"):
        with_adapters(spec, LoRAConfig(4, target_modules=("linear_q", "linear_fc1_gate")))
    spec.submodules.mlp.submodules.experts = ModuleSpec(module=TEGroupedMLP)
    with pytest.raises(ValueError, match=r"^--lora-rank with --moe-grouped-gemm: TransformerEngine's grouped experts "
                                         r"\(TEGroupedMLP\) take no LoRA adapters; LoRA adapts megatron-core's local "
                                         r"GroupedMLP and sequential experts \(use the local layer spec\)$"):
        with_adapters(spec, LoRAConfig(4))
