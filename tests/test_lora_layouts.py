"""LoRA is exact under every layout (issue 44, docs/lora.md "Exactness"): the trainer's model chunks
with adapters (`build_model` / `build_model_chunks`, through megatron-core's schedules, Megatron's
DDP and `finalize_model_grads`) give the loss and every adapter gradient of one rank, in float64,
under single / CP / BP / CSBP, each with TP 2 + sequence parallelism, EP 2 (a flag-built MoE,
sequential experts) and PP 2 (tolerances: tests/gradients.py). The adapters' initial weights are one
rank's (drawn by global name), B included (`--lora-init random`: PEFT's init_lora_weights=False,
so that A gets a gradient); the base weights get no gradient and no optimizer state.

Each spawned rank first computes the one-rank reference in-process (every parallel size 1, the
micro-batches one after the other), then its layout's chunks from the same seed.
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

L, B, VOCAB, MBS, M = 32, 8, 64, 2, 4
MOE = dict(num_experts=4, moe_router_topk=2)


def model_args(tp=1, cp=1, bp=1, sp=False, pp=1, ep=1, moe=False, num_layers=2, **lora):
    from megatron_csbp.training.model import ModelArgs

    return ModelArgs(num_layers=num_layers, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                     num_query_groups=2, seq_length=L, vocab_size=VOCAB, block_size=B, mask_token_id=VOCAB - 1,
                     tensor_model_parallel_size=tp, context_parallel_size=cp, block_parallel_size=bp,
                     sequence_parallel=sp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                     attention_kernel="tiled", swiglu=True, lora_rank=4, lora_alpha=6.0, lora_init="random",
                     **dict(MOE if moe else {}), **lora)


def batches():
    g = torch.Generator().manual_seed(5)
    out = []
    for j in range(M):
        tokens = torch.randint(0, VOCAB - 1, (MBS, L), generator=g)
        loss_mask = torch.ones_like(tokens)
        loss_mask[0, : 3 + j] = 0
        out.append(dict(tokens=tokens, loss_mask=loss_mask, sample_index=torch.arange(j * MBS, (j + 1) * MBS)))
    return out


def _fp64(build):
    from megatron_csbp.model import assemble

    orig = assemble.params_dtype
    assemble.params_dtype = lambda a: EXACT_DTYPE
    try:
        return build()
    finally:
        assemble.params_dtype = orig


def _reference(a):
    from megatron_csbp.lora import is_adapter
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.training.model import build_model

    bps.initialize_block_parallel()
    model = _fp64(lambda: build_model(a)).to(EXACT_DTYPE)
    data = batches()
    den = sum(model.bdlm.objective.denominator(b["loss_mask"]) for b in data).to(EXACT_DTYPE)
    loss, every = one_rank_reference(model, model.gpt, data, den)
    named = dict(model.gpt.named_parameters())
    assert all(p.grad is not None for n, p in named.items() if is_adapter(n)), "an adapter got no gradient"
    grads = {n: g for n, g in every.items() if is_adapter(n)}
    state = {n: p.detach().clone() for n, p in named.items()}
    base_grads = [n for n, p in named.items() if not is_adapter(n) and (p.requires_grad or p.grad is not None)]
    bps.destroy_block_parallel()
    return loss, grads, state, base_grads


def _global(name, offset, first_expert):
    name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{first_expert + int(m.group(1))}.", name)


def _layout(a, ref_grads, ref_state):
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_csbp.lora import is_adapter
    from megatron_csbp.parallel import pipeline
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.training.model import build_model_chunks

    bps.initialize_block_parallel(a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                                  a.context_parallel_size, a.block_parallel_size, a.expert_model_parallel_size)

    def finalize(chunks, num_tokens=None, **kw):
        return finalize_model_grads(chunks, None, **kw)

    chunks = [c.to(EXACT_DTYPE) for c in _fp64(lambda: build_model_chunks(a, finalize_model_grads_func=finalize))]
    ddps = [DistributedDataParallel(c.config, DistributedDataParallelConfig(grad_reduce_in_fp32=False), c,
                                    disable_bucketing=i > 0) for i, c in enumerate(chunks)]
    for c in chunks:
        c.config.no_sync_func = ddps[0].no_sync if len(ddps) == 1 else [d.no_sync for d in ddps]
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    experts = a.num_experts or 0
    first_expert = mpu.get_expert_model_parallel_rank() * experts // a.expert_model_parallel_size

    def rank_of(name):
        expert = "local_experts" in name
        return mpu.get_expert_tensor_parallel_rank() if expert else mpu.get_tensor_model_parallel_rank()

    init_err, pairs, base_with_grad = 0.0, [], []
    data = batches()
    den = sum(chunks[0].bdlm.objective.denominator(b["loss_mask"]) for b in data).to(EXACT_DTYPE)
    losses = []
    get_forward_backward_func()(
        forward_step_func=pipeline_forward_step(den, losses), data_iterator=iter(data[dp_rank::dp]),
        model=ddps, num_microbatches=M // dp, seq_length=pipeline.p2p_seq_length(chunks[0].bdlm),
        micro_batch_size=MBS, forward_only=False)
    loss = torch.tensor([sum(losses)], dtype=EXACT_DTYPE)
    dist.all_reduce(loss)  # the last stage's partials over the shard group and the DP replicas,
    loss /= a.tensor_model_parallel_size  # each held by every TP rank
    for c in chunks:
        offset = pipeline.first_layer(c.config, c.gpt.vp_stage)
        for n, p in c.gpt.named_parameters():
            if not is_adapter(n):
                if p.requires_grad or getattr(p, "main_grad", None) is not None or p.grad is not None:
                    base_with_grad.append(n)
                continue
            g = _global(n, offset, first_expert)
            init_err = max(init_err, float((p.detach() - tp_slice(ref_state[g], p, rank_of(n))).abs().max()))
            pairs.append((p.main_grad.detach().clone(), tp_slice(ref_grads[g], p, rank_of(n))))
    in_optimizer = None
    bps.destroy_block_parallel()
    worst, rel_norm = gradient_error(pairs)
    return float(loss), worst, rel_norm, init_err, base_with_grad, len(pairs), in_optimizer


def _rank(rank, world, cases):
    from megatron_csbp.compat.cpu import install_cpu_compat

    install_cpu_compat()
    out = []
    for kw in cases:
        a = model_args(**kw)
        same = {k: v for k, v in kw.items() if k.startswith("lora_")}  # the reference adapts the same targets
        ref_loss, ref_grads, ref_state, ref_base = _reference(model_args(moe=kw.get("moe", False), **same))
        loss, worst, rel_norm, init_err, base, n, _ = _layout(a, ref_grads, ref_state)
        out.append(dict(case=kw, loss=loss, ref_loss=ref_loss, worst=worst, rel_norm=rel_norm, init_err=init_err,
                        base_with_grad=base + ref_base, adapters=n))
    return out


def _check(world, cases):
    for per_rank in run_distributed(_rank, world, cases):
        for r in per_rank:
            print(r)
            assert r["init_err"] == 0.0, r
            assert r["base_with_grad"] == [] and r["adapters"] > 0, r
            check_close(r["loss"], r["ref_loss"], r["worst"], r["rel_norm"],
                        MOE_TOL if r["case"].get("moe") else FP64_TOL, r["case"])


def test_two_ranks_tp_sp_pp_ep_csbp():
    _check(2, [dict(tp=2, sp=True), dict(pp=2), dict(ep=2, moe=True), dict(cp=2), dict(bp=2)])


def test_four_ranks_csbp_and_tp_sp_with_experts():
    _check(4, [dict(cp=2, bp=2), dict(tp=2, sp=True, ep=2, moe=True), dict(pp=2, tp=2, sp=True)])


def _saved_then_read_on_one_rank(rank, world, case, root):
    """Save the adapters of a layout's chunks with dist_checkpointing, read them into the one-rank
    model: the full tensors must equal one rank's draws (TP-sharded B of SwiGLU's fc1, experts)."""
    from megatron.core import dist_checkpointing

    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.lora import is_adapter
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.training.model import build_model, build_model_chunks

    install_cpu_compat()
    a = model_args(**case)
    bps.initialize_block_parallel(a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                                  a.context_parallel_size, a.block_parallel_size, a.expert_model_parallel_size)
    (chunk,) = _fp64(lambda: build_model_chunks(a))
    sd = chunk.gpt.sharded_state_dict()
    dist_checkpointing.save({k: v for k, v in sd.items() if is_adapter(k)}, root)
    dist.barrier()
    bps.destroy_block_parallel()
    bps.initialize_block_parallel()
    ref = _fp64(lambda: build_model(model_args(moe=case.get("moe", False),
                                               **{k: v for k, v in case.items() if k.startswith("lora_")})))
    want = {k: v for k, v in ref.gpt.sharded_state_dict().items() if is_adapter(k)}
    drawn = {k: v.data.clone() for k, v in ref.gpt.state_dict(keep_vars=True).items() if is_adapter(k)}
    loaded = dist_checkpointing.load(want, root)
    bps.destroy_block_parallel()
    return {k: float((loaded[k] - drawn[k]).abs().max()) for k in drawn}


@pytest.mark.parametrize("world,case", [
    (2, dict(tp=2, sp=True, moe=True)),  # TP-sharded B of the experts' SwiGLU fc1, A of fc2
    pytest.param(2, dict(tp=2, sp=True, lora_target_modules=("linear_q", "linear_k", "linear_v", "linear_fc1_gate",
                                                              "linear_fc1_up")), marks=pytest.mark.slow),  # part B's
    pytest.param(4, dict(tp=2, ep=2, sp=True, moe=True), marks=pytest.mark.slow),
    pytest.param(2, dict(pp=2, tp=1), marks=pytest.mark.slow)])
def test_adapter_checkpoint_is_layout_independent(tmp_path, world, case):
    for per_rank in run_distributed(_saved_then_read_on_one_rank, world, case, str(tmp_path)):
        assert per_rank and all(err == 0.0 for err in per_rank.values()), per_rank


SHARDS = [dict(), dict(cp=2), dict(bp=2), dict(cp=2, bp=2)]  # single, CP, BP, CSBP


@pytest.mark.slow
def test_matrix_two_ranks():
    # EP 2 over the shard group (plain BP with EP is refused by the trainer: unequal rows per
    # expert rank), TP 2 with and without SP, PP 2
    _check(2, [dict(s, ep=2, moe=True) for s in SHARDS if s != dict(bp=2)]
           + [dict(tp=2, sp=True), dict(tp=2), dict(pp=2), dict(pp=2, moe=True)])


@pytest.mark.slow
def test_matrix_four_ranks():
    # CP, BP and CSBP each with TP 2 + SP and with PP 2; CSBP x PP 2 with EP 2 experts
    _check(4, [dict(s, **p) for s in SHARDS[1:] for p in (dict(tp=2, sp=True), dict(pp=2))]
           + [dict(cp=2, bp=2, pp=2, ep=2, moe=True), dict(bp=2, tp=2, sp=True, moe=True)])


def _family_rank(rank, world, family):
    """tests/test_pipeline_families.py's PP 2 x CSBP run (DiffusionGemma: EP 2 over the shard group)
    with adapters on every projection: the adapters' gradients equal one rank's."""
    from megatron.core import parallel_state as mpu

    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.lora import LoRAConfig, is_adapter
    from megatron_csbp.lora.spec import adapted
    from megatron_csbp.parallel import pipeline
    from megatron_csbp.parallel import state as bps
    from tests import test_pipeline_families as F
    from tests.gradients import one_rank_reference

    install_cpu_compat()
    lora = LoRAConfig(4, alpha=6.0, init="random")

    def build(stage, **kw):
        out = {}
        gpt = adapted(lora, lambda: out.setdefault("r", F.FAMILIES[family](stage, **kw))[0], seed=11)
        return (gpt, *out["r"][1:])

    bps.initialize_block_parallel()
    gpt, kind, L, tol = build(pipeline.WHOLE)
    drawn = {n: p.detach().clone() for n, p in gpt.named_parameters() if is_adapter(n)}
    F._redraw(family, gpt)  # base and adapters (the layout loads them all by global name)
    state = {k: v.clone() for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    model = F._bdlm(gpt, kind, L)
    data = F._batches(L)
    den = sum(model.objective.denominator(b["loss_mask"]) for b in data).to(EXACT_DTYPE)
    ref_loss, ref_grads = one_rank_reference(model, gpt, data, den)
    bps.destroy_block_parallel()

    ep = 2 if family == "diffusion_gemma" else 1
    bps.initialize_block_parallel(1, 2, 2, 2, ep)
    (vp,) = pipeline.virtual_stages()
    pre, post = pipeline.stage_of(vp)
    gpt, kind, L, tol = build(pipeline.Stage(pre, post, vp), pp=2, ep=ep)
    config = gpt.config
    offset = pipeline.first_layer(config, vp)
    first_expert = mpu.get_expert_model_parallel_rank() * (F.EXPERTS // ep)
    names = {n: _global(n, offset, first_expert) for n in gpt.state_dict() if not n.endswith("_extra_state")}
    names = {n: g if g in state else "embedding.word_embeddings.weight" for n, g in names.items()}
    init_err = max(float((p.detach() - drawn[names[n]]).abs().max()) for n, p in gpt.named_parameters() if is_adapter(n))
    gpt.load_state_dict({n: state[g] for n, g in names.items()}, strict=False)
    loss = F.pp2_csbp_loss(gpt, kind, L, data, den)
    pairs = [(p.main_grad.detach().clone(), ref_grads[names[n]]) for n, p in gpt.named_parameters() if is_adapter(n)]
    frozen = all(not p.requires_grad for n, p in gpt.named_parameters() if not is_adapter(n))
    bps.destroy_block_parallel()
    worst, rel_norm = gradient_error(pairs)
    return dict(loss=float(loss), ref_loss=ref_loss, worst=worst, rel_norm=rel_norm, tol=tol, adapters=len(pairs),
                init_err=init_err, frozen=frozen)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["diffusion_gemma", "hybrid"])
def test_family_adapters_pp2_csbp_match_one_rank(family):
    for r in run_distributed(_family_rank, 4, family):
        print(family, r)
        assert r["adapters"] > 0 and r["init_err"] == 0.0 and r["frozen"], r
        check_close(r["loss"], r["ref_loss"], r["worst"], r["rel_norm"], r["tol"], family)
