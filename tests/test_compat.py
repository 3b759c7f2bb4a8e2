"""The CPU shim: every patched path is exercised for real on gloo (no CUDA on these machines)."""
import os

import pytest
import torch

from tests.distributed import run_distributed

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shim is inactive with CUDA")


def _tiny_args(**over):
    from megatron_csbp.training.model import ModelArgs
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                seq_length=32, vocab_size=60, block_size=8, mask_token_id=59, seed=7)
    base.update(over)
    return ModelArgs(**base)


def test_install_is_idempotent_and_documented():
    from megatron_csbp.compat import cpu
    assert cpu.install_cpu_compat() is True
    import megatron.core.tensor_parallel.random as random_mod
    cls = random_mod.CudaRNGStatesTracker
    assert cpu.install_cpu_compat() is True
    assert random_mod.CudaRNGStatesTracker is cls  # not wrapped twice
    for needle in ("model_parallel_cuda_manual_seed", "DistributedOptimizer", "te_general_gemm",
                   "WrappedTorchNorm", "dist_checkpointing", "all-to-all", "rotary"):
        assert needle in cpu.__doc__


def test_rng_tracker_fork_and_recompute_replay():
    from megatron_csbp.compat.cpu import install_cpu_compat
    install_cpu_compat()
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    tracker = get_cuda_rng_tracker()
    default_before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    with tracker.fork():
        b = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), default_before), "fork must restore the default generator"
    assert not torch.equal(a, b), "fork must save the advanced state"
    # Same seed => same tracked stream; the tracker's stream differs from the default one.
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
    with get_cuda_rng_tracker().fork():
        a2 = torch.rand(4)
    assert torch.equal(a, a2)
    assert not torch.equal(a, torch.rand(4))

    # Activation recompute must replay the same dropout masks (tracked and default RNG).
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(5, 8, requires_grad=True)

    def f(inp):
        with get_cuda_rng_tracker().fork():
            h = torch.nn.functional.dropout(inp @ w, 0.5, training=True)
        return torch.nn.functional.dropout(h, 0.3, training=True)

    state = torch.get_rng_state()
    tracked = get_cuda_rng_tracker().get_states()
    tracked = {k: v.clone() for k, v in tracked.items()}
    ref = f(x)
    ref.sum().backward()
    ref_grads = (w.grad.clone(), x.grad.clone())
    w.grad = x.grad = None
    torch.set_rng_state(state)
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in tracked.items()})
    out = tensor_parallel.checkpoint(f, False, x)
    out.sum().backward()
    assert torch.equal(out, ref)
    assert torch.equal(w.grad, ref_grads[0]) and torch.equal(x.grad, ref_grads[1])


META = {"distrib_optim_sharding_type": "fully_reshardable"}


def _tp_model_rank(rank, world_size, tp, sp, tmpdir):
    torch.set_num_threads(1)
    from megatron_csbp.compat.cpu import install_cpu_compat
    install_cpu_compat()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron_csbp.parallel import state as bps
    from megatron_csbp.training.model import build_model

    bps.initialize_block_parallel(tensor_model_parallel_size=tp)
    args = _tiny_args(tensor_model_parallel_size=tp, sequence_parallel=sp)
    model = build_model(args, finalize_model_grads_func=lambda m, num_tokens=None, **k: finalize_model_grads(m, None))
    # Full (TP-gathered) initial weights, to compare with the TP = 1 build.
    full = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            from tests.gradients import gather_tensor_parallel
            t = gather_tensor_parallel(t, p, mpu.get_tensor_model_parallel_group())
        full[name] = t.clone()
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.01,
                                                 use_distributed_optimizer=True), [ddp])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 59, (2, 32), generator=g)
    losses = []
    for step in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = ddp(tokens, sample_index=torch.tensor([0, 1]))
        out.loss.backward()
        finalize_model_grads([ddp], None)
        ok, grad_norm, _ = opt.step()
        losses.append(float(out.loss))
    norm_params = {n: p.detach().clone() for n, p in model.named_parameters() if "layernorm" in n}
    # dist_checkpointing round trip (torch_dist), including the distributed optimizer state.
    sd = {"model": model.sharded_state_dict()}
    sd["optimizer"] = opt.sharded_state_dict(sd, metadata=META)
    ckpt = os.path.join(tmpdir, f"tp{tp}")
    if rank == 0:
        os.makedirs(ckpt, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sd, ckpt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sd2 = {"model": model.sharded_state_dict()}
    sd2["optimizer"] = opt.sharded_state_dict(sd2, is_loading=True, metadata=META)
    loaded = dist_checkpointing.load(sd2, ckpt)
    model.gpt.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    restored = all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    return dict(full=full if rank == 0 else None, losses=losses, grad_norm=grad_norm, restored=restored,
                norm_params=norm_params, sp=_plain_gpt_sequence_parallel(tp))


def _plain_gpt_sequence_parallel(tp):
    """Megatron's own GPT (local spec, torch norms) with --sequence-parallel when TP > 1: the norm
    parameters are tagged and their gradients all-reduced over TP by finalize_model_grads."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            tensor_model_parallel_size=tp, sequence_parallel=tp > 1, use_cpu_initialization=True,
                            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                            normalization="RMSNorm", calculate_per_token_loss=True)
    torch.manual_seed(5)
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64, max_sequence_length=16)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), gpt)
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16)[None]
    mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), 1)
    loss = ddp(tokens, pos, mask, labels=tokens).sum()
    loss.backward()
    finalize_model_grads([ddp], None)
    grads = {n: p.main_grad.clone() for n, p in gpt.named_parameters() if "layernorm" in n}
    tags = all(getattr(p, "sequence_parallel", False) == (tp > 1) for n, p in gpt.named_parameters()
               if "layernorm" in n)
    return dict(loss=float(loss), grads=grads, tags=tags)


def test_tp2_init_ddp_distopt_clip_checkpoint(tmp_path):
    ref = run_distributed(_tp_model_rank, 1, 1, False, str(tmp_path))[0]
    tp2 = run_distributed(_tp_model_rank, 2, 2, False, str(tmp_path))
    # Megatron's CPU init + TP split reproduces the TP = 1 weights exactly (layout-independent init).
    assert ref["full"].keys() == tp2[0]["full"].keys()
    for name in ref["full"]:
        assert torch.equal(ref["full"][name], tp2[0]["full"][name]), name
    # Training steps through DDP + distributed optimizer + grad clipping agree with TP = 1.
    # Error model (fp32, u = 2^-24 ~ 6e-8): TP = 2 only reorders sums: the row-parallel linears
    # (attention output over h = 32, fc2 over ffn = 64) become two half sums plus an all-reduce, and
    # the vocab-parallel cross entropy takes max / sum-exp over two halves. A reordered n-term sum
    # moves by <= n u sum|terms| (Higham), <= 64 u ~ 4e-6 of its magnitude, and the gradient norm
    # (a sum of squares of such values) likewise. Adam turns a relative gradient error e into an
    # update error lr * e (lr = 1e-2) where |g| >> eps, more where m / sqrt(v) nearly cancels.
    # Bounds: loss 1e-5 relative, grad norm 1e-4, norm weights (~1) 1e-5 relative + 1e-6; measured
    # (this machine, avx2): losses identical, grad norm 4e-8 relative, norm weights 8.3e-7 absolute.
    for r in tp2:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
        assert r["restored"]
    for n, p in ref["norm_params"].items():
        assert torch.allclose(tp2[0]["norm_params"][n], p, rtol=1e-5, atol=1e-6), n
    # Sequence-parallel torch norms (Megatron's plain GPT): tagged, and their gradients summed over
    # the sequence shards, so both TP ranks hold the TP = 1 gradient. A norm weight's gradient is a
    # sum over the 16 positions, split 8 + 8 by SP: <= 16 u ~ 1e-6 of its magnitude moves; bound
    # 1e-4 relative + 1e-6 (the loss itself is a 16-token sum: 1e-5); measured 2.8e-7 of the largest.
    assert ref["sp"]["tags"] and all(r["sp"]["tags"] for r in tp2)
    for r in tp2:
        assert r["sp"]["loss"] == pytest.approx(ref["sp"]["loss"], rel=1e-5)
        for n, g in ref["sp"]["grads"].items():
            assert torch.allclose(r["sp"]["grads"][n], g, rtol=1e-4, atol=1e-6), n


def _moe_rank(rank, world_size, ep):
    torch.set_num_threads(1)
    from megatron_csbp.compat.cpu import install_cpu_compat
    install_cpu_compat()
    import torch.nn.functional as F
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.megatron_specs import spec_submodules

    mpu.initialize_model_parallel(expert_model_parallel_size=ep)
    results = {}
    for dispatcher in ("alltoall", "allgather"):  # one process start for both (the costly part)
        tensor_parallel.model_parallel_cuda_manual_seed(3)
        cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                                moe_router_topk=2, moe_token_dispatcher_type=dispatcher,
                                expert_model_parallel_size=ep, use_cpu_initialization=True, add_bias_linear=False,
                                moe_ffn_hidden_size=32, ffn_hidden_size=32, gated_linear_unit=True,
                                activation_func=F.silu, moe_router_load_balancing_type="none")
        spec = spec_submodules(get_gpt_layer_local_spec(num_experts=4).submodules.mlp)
        torch.manual_seed(0)
        layer = MoELayer(cfg, spec)
        # every rank's weights, keyed by the global expert index, for the float64 brute force
        local = layer.experts.local_experts
        first = rank * len(local)  # EP rank r holds experts [r * 4 / EP, (r + 1) * 4 / EP)
        experts = {first + i: (e.linear_fc1.weight.detach().clone(), e.linear_fc2.weight.detach().clone())
                   for i, e in enumerate(local)}
        x = torch.randn(6, 1, 16, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        out, _ = layer(x)
        out.sum().backward()
        results[dispatcher] = dict(out=out.detach(), grad=x.grad.clone(), x=x.detach(),
                                   router=layer.router.weight.detach().clone(), experts=experts)
    return results


def _moe_brute_force(x, router, experts, topk, xmag=None):
    """Megatron's MoE layer written out in float64 (an oracle independent of its dispatchers):
    top-k of the router logits, softmax over the chosen k (moe_router_pre_softmax off), each token
    through its experts' SwiGLU MLP (fc1 = [gate; up]), summed with those probabilities.

    Also returns the magnitudes that scale the rounding bounds: `mag`, the same formula on absolute
    values with the same routing, p |W2| ((|W1g| xmag) * (|W1u| xmag)) with xmag = |x| (the sum of
    |terms|, since |silu(g)| <= |g|); its gradient w.r.t. xmag bounds the |terms| of the expert path
    of the input gradient; `rmag` bounds those of the router path: d out / d logit_j = p_j (v_j - sum
    p v) with v the expert outputs, so |.| <= 2 max_j |v_j| per chosen expert, times |W_router[j]|."""
    x = x.reshape(-1, x.shape[-1]).double()
    xmag = x.detach().abs() if xmag is None else xmag.reshape(x.shape)
    logits = x @ router.double().t()
    top, idx = logits.topk(topk, dim=-1)
    p = torch.softmax(top, dim=-1)
    out, mag, rmag = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(x)
    for t in range(x.shape[0]):
        vmag = []
        for j in range(topk):
            w1, w2 = (w.double() for w in experts[int(idx[t, j])])
            gate, up = (w1 @ x[t]).chunk(2)
            out[t] += p[t, j] * (w2 @ (torch.nn.functional.silu(gate) * up))
            g_abs, u_abs = (w1.abs() @ xmag[t]).chunk(2)
            v = w2.abs() @ (g_abs * u_abs)
            mag[t] += p[t, j].detach() * v
            vmag.append(float(v.detach().sum()))
        for j in range(topk):
            rmag[t] += 2 * max(vmag) * router[int(idx[t, j])].double().abs()
    return out, mag, rmag


def test_moe_dispatchers_ep2_equal_float64_brute_force():
    """Megatron's MoE layer at EP = 2 on gloo (router on the CPU device, te_general_gemm defined,
    all-to-all with list split sizes, and the allgather dispatcher) gives each rank's tokens the
    output and input gradient of a float64 brute force over all four experts (gathered from both
    ranks): wrong routing, a lost token or a wrong expert would move them by O(|out|).

    Error model (fp32, u = 2^-24 ~ 6e-8): an output is a p-weighted sum of a length-32 dot (fc2) of
    products of two length-16 dots (fc1), after a length-16 router dot and a 2-way softmax; with
    Higham's n u sum|terms| per dot, the chain is within (16 + 16 + 32 + 16 + 2) u ~ 5e-6 of `mag`
    (the sum of |terms|). Backward runs the same dots transposed (same lengths), bounded by its own
    term magnitudes (gmag, rmag). The bounds used, 1e-4 of those magnitudes, are 20x the model."""
    both = run_distributed(_moe_rank, 2, 2)
    for dispatcher in ("alltoall", "allgather"):
        _check_moe_ranks([r[dispatcher] for r in both])


def _check_moe_ranks(res):
    experts = {**res[0]["experts"], **res[1]["experts"]}
    assert sorted(experts) == [0, 1, 2, 3]
    assert torch.equal(res[0]["router"], res[1]["router"])
    for r in res:
        x = r["x"].double().requires_grad_(True)
        ref, mag, rmag = _moe_brute_force(x, r["router"], experts, topk=2)
        ref.sum().backward()
        assert ((r["out"].reshape(ref.shape).double() - ref).abs() <= 1e-4 * mag).all()
        assert (mag > 0).all() and ref.abs().max() > 1e-3 * mag.max()  # not vacuous
        gmag = torch.autograd.functional.vjp(
            lambda m: _moe_brute_force(r["x"], r["router"], experts, 2, xmag=m)[1],
            x.detach().abs().reshape(ref.shape), torch.ones_like(ref))[1]
        err = (r["grad"].reshape(ref.shape).double() - x.grad.reshape(ref.shape)).abs()
        assert (err <= 1e-4 * (gmag + rmag)).all(), err.max()


def _recompute_rank(rank, world_size):
    from tests.train_helpers import TINY
    from megatron_csbp.training.loop import main
    return [h["loss"] for h in main(TINY + ["--train-iters", "2", "--recompute-granularity", "full"])["history"]]


@pytest.mark.slow
def test_full_recompute_matches_plain():
    """--recompute-granularity full: Megatron's CheckpointFunction replays each layer (RNG states
    on the CPU generator through the shim) and the loss curve is unchanged."""
    from tests.train_helpers import TINY, train_rank
    ref = run_distributed(train_rank, 1, TINY + ["--train-iters", "2"])[0]["losses"]
    assert run_distributed(_recompute_rank, 1)[0] == pytest.approx(ref, rel=1e-6)


def _send_then_deallocate_rank(rank, world_size, patched):
    """Rank 0 posts an async send of a stage output and pseudo-deallocates it at once (Megatron-LM's
    `deallocate_pipeline_outputs`, the interleaved schedule with overlapped P2P), then fills fresh
    tensors of the same size (the allocator hands out what was freed); rank 1 posts its receive
    later. What rank 1 receives must be what was sent. Without the patch rank 0's send reads freed
    memory: rank 1 receives the filler, or the run crashes (the 16 MiB were returned to the OS)."""
    import time

    import torch.distributed as dist
    from megatron.core.pipeline_parallel import schedules

    from megatron_csbp.compat import cpu
    cpu.install_cpu_compat()
    deallocate = schedules.deallocate_output_tensor if patched else schedules.deallocate_output_tensor.__wrapped__
    n = 1 << 22  # 16 MiB of float32: more than a loopback socket buffers, so the send is still in flight
    sent = torch.arange(n, dtype=torch.float32)
    if rank == 0:
        out = sent.clone().requires_grad_(True) * 1.0  # a stage output: not a view, has a grad_fn
        work = dist.isend(out, dst=1)
        deallocate(out, True)
        assert out.numel() == 1  # the schedule's backward (custom_backward) relies on it
        filler = [torch.full((n,), -1.0) for _ in range(4)]
        work.wait()
        del filler
        return True
    time.sleep(1.0)
    got = torch.empty(n)
    dist.recv(got, src=0)
    return bool(torch.equal(got, sent))


def test_async_send_survives_output_deallocation():
    assert run_distributed(_send_then_deallocate_rank, 2, True) == [True, True]
