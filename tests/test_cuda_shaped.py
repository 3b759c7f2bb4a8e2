"""The cuda_shaped tier: the trainer and model paths on ranks that believe CUDA is present, NCCL
is the backend and neither TransformerEngine nor apex is installed (tests/cuda_shaped.py is the
device; what the tier proves and what it does not: docs/testing.md).

Each of issue 31's GPU bugs has a test here that failed before its fix:
- TP + --sequence-parallel with megatron-core's torch norm (the trainer forces the local spec),
  with MoE (which the trainer runs with SP under TP): `test_tp_sp_moe_trains_like_one_rank`
  (before: "sequence parallel not supported by torch LayerNorm", the norm fix was CPU-only);
- MoE without TE: the same test, megatron-core's router (before: NameError te_general_gemm;
  DiffusionGemma's own router in the EP test below never names it);
- the expert peers' agreement on the canvas start and the self-conditioning pass all-reduced a CPU
  tensor on the (NCCL) expert group: `test_ep_canvas_self_conditioning_equals_one_rank`;
- torch Adam's state on resume: `test_torch_adam_save_and_exact_resume` (before: the load into a
  fresh run asserted on the missing per-parameter step);
- exposed communication timed with CUDA events: `test_exposed_communication_is_timed_with_cuda_events`.

Tolerances: fp32 trainer runs are compared with one CPU rank as tests/test_train_moe.py does (1e-5
relative; its derivation there); the DiffusionGemma EP case runs in float64 (tests/gradients.py).
"""
import os

import pytest

from tests import cuda_shaped
from tests.distributed import run_distributed
from tests.train_helpers import TINY, train_rank

pytestmark = pytest.mark.cuda_shaped

REL = 1e-5
# The device runs no CUDA kernel: "cuda" attention would pick Flex, whose backward has no CPU
# implementation, and cpu_flash refuses CUDA tensors: the portable tiled kernel (torch ops on any
# device; the reference CPU rank runs it too).
KERNEL = ["--attention-kernel", "tiled"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--adam-eps", "1e-3"]


# ---- the harness itself -----------------------------------------------------------------------------
def _harness_rank(rank, world_size):
    import torch
    import torch.distributed as dist

    out = {"backend": dist.get_backend(), "is_available": torch.cuda.is_available()}
    t = torch.ones(2, device="cuda") * (rank + 1)
    dist.all_reduce(t)
    out["cuda_sum"] = t.tolist()
    out["reports"] = str(t.device)
    sub = dist.new_group([0, 1])
    out["sub_backend"] = dist.get_backend(sub)
    refused = []
    for what, make in [("cpu tensor", lambda: torch.ones(2)), ("a CUDA tensor's .cpu()", lambda: t.cpu()),
                       ("a tensor built on the CPU from CUDA values", lambda: torch.tensor(t.tolist()))]:
        try:
            dist.all_reduce(make(), group=sub)
            refused.append((what, None))
        except RuntimeError as exc:
            refused.append((what, str(exc)))
    buf = torch.empty(4)  # an all-gather into a CPU buffer is refused too
    try:
        dist.all_gather_into_tensor(buf, t, group=sub)
        refused.append(("cpu output buffer", None))
    except RuntimeError as exc:
        refused.append(("cpu output buffer", str(exc)))
    out["refused"] = refused
    gloo = dist.new_group([0, 1], backend="gloo")  # a real gloo group takes CPU tensors
    c = torch.ones(1)
    dist.all_reduce(c, group=gloo)
    out["gloo"] = (dist.get_backend(gloo), c.item())
    # derived tensors follow their inputs: activations and gradients of a model on "cuda"
    lin = torch.nn.Linear(2, 2).cuda()
    lin(t).sum().backward()
    g = lin.weight.grad.clone()
    dist.all_reduce(g, group=sub)
    out["grad_device"] = str(g.device)
    return out


def test_harness_refuses_cpu_tensors_on_nccl_groups():
    """The device is only as good as its refusals: a CPU tensor on an NCCL group fails, as on a GPU."""
    for r in cuda_shaped.run(_harness_rank, 2):
        assert r["backend"] == "nccl" and r["sub_backend"] == "nccl" and r["is_available"]
        assert r["cuda_sum"] == [3.0, 3.0] and r["reports"] == "cuda:" + str(r["reports"][-1])
        for what, err in r["refused"]:  # NCCL's refusal, or the device rule's first (a CPU buffer beside a CUDA input)
            assert err is not None and ("No backend type associated with device type cpu" in err or (
                what == "cpu output buffer" and err.startswith("Expected all tensors to be on the same device"))), (what, err)
        assert r["gloo"] == ("gloo", 2.0)
        assert r["grad_device"].startswith("cuda")


def _device_rule_rank(rank, world_size):
    import torch

    c, h = torch.randn(4, 4, device="cuda"), torch.randn(4, 4)
    refused = {
        "add": lambda: c + h, "cat": lambda: torch.cat([c, h]), "index_select": lambda: c.index_select(0, torch.tensor([0, 1])),
        "where": lambda: torch.where(h > 0, c, c), "matmul": lambda: c @ h, "masked_fill_": lambda: c.clone().masked_fill_(h > 0, 0.0),
        "index_put_ of CPU values": lambda: c.clone().__setitem__(torch.tensor([0]), torch.ones(1, 4)),
        "a CPU tensor indexed by CUDA indices": lambda: h[torch.tensor([0], device="cuda")],
        "bf16 matmul": lambda: c.bfloat16() @ h.bfloat16(),
    }
    allowed = {  # what CUDA accepts: 0-dim CPU tensors and Python numbers, copies, CPU indices, moves
        "0-dim CPU scalar": lambda: c * torch.tensor(2.0), "python scalar": lambda: c * 2, "copy_": lambda: c.clone().copy_(h),
        "CPU indices": lambda: c[torch.tensor([0, 1])], "CPU bool mask": lambda: c[h > 0],
        "slice assignment of CPU values": lambda: c.clone().__setitem__(slice(0, 2), h[:2]), "to": lambda: h.to(c) + c,
        "new_tensor": lambda: c.new_tensor([1.0, 2, 3, 4]) + c, "type_as": lambda: h.type_as(c) + c,
        "arange on x.device": lambda: torch.arange(4, device=c.device) + c,
        "a module moved to cuda, forward and backward in bf16": lambda: torch.nn.Linear(4, 4).cuda().bfloat16()(
            c.bfloat16().requires_grad_()).sum().backward(),
        "Adam (its CPU step counts)": lambda: (lambda p: (p.sum().backward(), torch.optim.Adam([p]).step()))(
            torch.nn.Parameter(torch.ones(3, device="cuda"))),
    }
    out = {}
    for what, fn in refused.items():
        try:
            fn()
            out[what] = None
        except RuntimeError as exc:
            out[what] = str(exc)
    for what, fn in allowed.items():
        try:
            fn()
            out[what] = "ran"
        except RuntimeError as exc:
            out[what] = str(exc)
    return out, list(allowed)


def test_a_cpu_tensor_beside_cuda_tensors_fails_as_on_cuda():
    """CUDA refuses an op that mixes a CUDA tensor with a (non-scalar) CPU tensor; so does the device,
    with CUDA's messages, while what CUDA accepts runs."""
    out, allowed = cuda_shaped.run(_device_rule_rank, 1)[0]
    for what, err in out.items():
        if what in allowed:
            assert err == "ran", (what, err)
        elif what == "masked_fill_":
            assert err.startswith("expected self and mask to be on the same device, but got mask on cpu and self on cuda:0")
        elif what.startswith("a CPU tensor indexed"):
            assert err == "indices should be either on cpu or on the same device as the indexed tensor (cpu)"
        else:
            assert err is not None and err.startswith(
                "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"), (what, err)


# ---- item 5: exposed communication timed with CUDA events -------------------------------------------
def _transport_rank(rank, world_size):
    import torch
    import torch.distributed as dist

    from megatron_csbp.attention.accounting import traffic_counter
    from megatron_csbp.attention.transports import PendingGather, ring_chunks

    ticks = iter(range(1, 10 ** 6))
    cuda_shaped.EVENT_CLOCK[0] = lambda: float(next(ticks))  # each event record: one more second
    group = dist.new_group([0, 1])
    counter = traffic_counter()
    counter.reset()
    local = torch.randn(4, 3, device="cuda", requires_grad=True)
    full = PendingGather(local, group, layer=1).result()
    full.sum().backward()
    gather = (dict(counter.waited_s), dict(counter.in_flight_s))
    counter.reset()
    chunks = [c for _, c in ring_chunks(local, group, layer=2)]
    sum(c.sum() for c in chunks).backward()
    ring = (dict(counter.waited_s), dict(counter.in_flight_s))
    return {"gather": gather, "ring": ring, "reads": getattr(cuda_shaped.Event, "elapsed_reads", 0),
            "full": str(full.device)}


def test_exposed_communication_is_timed_with_cuda_events():
    """On an NCCL group `work.wait()` only makes the stream wait: a host clock around it reads ~0.
    The transports read CUDA events recorded on the stream; here every event record is one tick of
    a virtual clock, so the counter must hold whole seconds: posted, wait start, wait end -> 1 s
    waited, 2 s in flight; a blocking backward -> 1 s and 1 s."""
    for r in cuda_shaped.run(_transport_rank, 2):
        assert r["reads"] > 0 and r["full"].startswith("cuda")
        waited, flight = r["gather"]
        assert waited == {(1, "forward"): 1.0, (1, "backward"): 1.0}, waited
        assert flight == {(1, "forward"): 2.0, (1, "backward"): 1.0}, flight
        waited, flight = r["ring"]
        assert waited == {(2, "forward"): 1.0, (2, "backward"): 1.0}, waited
        assert flight == {(2, "forward"): 2.0, (2, "backward"): 1.0}, flight


# ---- the trainer -------------------------------------------------------------------------------------
def _reference(argv):
    return run_distributed(train_rank, 1, argv)[0]["losses"]


def _close(got, ref, name):
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    print(f"\n{name}: {got} vs one CPU rank {ref}: max rel diff {rel:.2e}")
    assert len(got) == len(ref) and rel <= REL, (name, got, ref)


def test_tp_sp_moe_trains_like_one_rank():
    """TP 2 + --sequence-parallel with MoE, torch norms (the local spec) and no TE: the losses of
    one rank."""
    argv = TINY + KERNEL + MOE + ["--train-iters", "2"]
    ref = _reference(argv)
    for r in cuda_shaped.run(train_rank, 2, argv + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]):
        _close(r["losses"], ref, "TP 2 + SP, MoE")


def test_pp2_p2p_trains_like_one_rank():
    """Pipeline P2P between two stages over an NCCL group: the losses of one rank."""
    argv = TINY + KERNEL + ["--train-iters", "2"]
    ref = _reference(argv)
    for r in cuda_shaped.run(train_rank, 2, argv + ["--pipeline-model-parallel-size", "2"]):
        _close(r["losses"], ref, "PP 2")


def _resume_rank(rank, world_size, argv, save):
    import time

    from megatron_csbp.parallel.spawn import free_port

    first = train_rank(rank, world_size, argv + ["--save", save, "--save-interval", "1"])
    # the first run tore its process group down: the second meets on a free port rank 0 picks
    port_file = save + ".port"
    if rank == 0:
        with open(port_file + ".tmp", "w") as f:
            f.write(str(free_port()))
        os.replace(port_file + ".tmp", port_file)
    while not os.path.exists(port_file):
        time.sleep(0.01)
    with open(port_file) as f:
        os.environ["MASTER_PORT"] = f.read()
    resumed = train_rank(rank, world_size, argv + ["--load", save, "--ckpt-step", "1"])
    return {"first": first["losses"], "resumed": resumed["losses"], "iteration": resumed["iteration"]}


def test_torch_adam_save_and_exact_resume(tmp_path):
    """Data parallel 2 with the distributed optimizer over torch Adam (no TE or apex fused Adam):
    a run resumed from iteration 1 continues with the losses of the uninterrupted run. Before the
    fix the load asserted (torch Adam has no per-parameter step before its first step); with the
    load fixed but one shared step tensor the resumed updates use other bias corrections."""
    argv = TINY + KERNEL + ["--train-iters", "3", "--use-distributed-optimizer"]
    for r in cuda_shaped.run(_resume_rank, 2, argv, str(tmp_path / "ckpt")):
        assert r["iteration"] == 3 and len(r["first"]) == 3
        assert r["resumed"] == r["first"][1:], (r["resumed"], r["first"])


# ---- the model: DiffusionGemma under EP with canvases and self-conditioning --------------------------
def _model(config):
    """tests/test_diffusiongemma_ep.py's model with the portable tiled attention kernel (KERNEL)."""
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model
    from megatron_csbp.model.diffusiongemma.sft import DiffusionGemmaSFTModel
    from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective
    from tests.test_diffusiongemma_ep import B, L, V

    gpt = diffusion_gemma_model(config, V, 64, kernel="tiled")
    obj = DiffusionGemmaSFTObjective(B, V, seed=7, encoder_loss_weight=0.5)
    return gpt, DiffusionGemmaSFTModel(gpt, obj, SequenceLayout(BlockGeometry(L, B, "token_causal")))


def _ep_rank(rank, world_size, state_path):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megatron_csbp.compat.cpu import install_cpu_compat
    from tests.test_diffusiongemma_ep import E, _batch, _config, _expert_key

    assert install_cpu_compat() is False  # "CUDA" present: the library fixes only, no CPU relocation
    mpu.initialize_model_parallel(expert_model_parallel_size=2)
    gpt, model = _model(_config(expert_model_parallel_size=2))
    full = torch.load(state_path)
    local = E // 2
    gpt.load_state_dict({k: full[_expert_key(k, rank, local)] for k in gpt.state_dict() if not k.endswith("_extra_state")},
                        strict=False)
    model.cuda()
    model.train()
    tokens, loss_mask, index = _batch()
    denominator = model.objective.denominator(loss_mask)
    out = model(tokens[rank: rank + 1].cuda(), loss_mask[rank: rank + 1].cuda(), index[rank: rank + 1], denominator)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    return {"loss": loss.item(), "device": str(loss.device)}


@pytest.mark.slow  # suite budget (14 s): tests/test_diffusiongemma_ep.py checks the same canvases on gloo by default; this is its CUDA-shaped twin
def test_ep_canvas_self_conditioning_equals_one_rank(tmp_path):
    """EP 2 MoE (no TE; megatron-core's all-to-all dispatcher over the NCCL expert group) through diffusiongemma-sft's canvases and self-conditioning (one sample
    draws it, the other not: the expert peers agree on both over the NCCL expert group): the loss
    of one CPU rank (tests/test_diffusiongemma_ep.py's reference, float64)."""
    from tests.gradients import MOE_TOL

    ref = run_distributed(_ep_reference, 1, str(tmp_path / "state.pt"))[0]
    for r in cuda_shaped.run(_ep_rank, 2, str(tmp_path / "state.pt")):
        assert r["device"].startswith("cuda")
        assert abs(r["loss"] - ref) <= MOE_TOL["loss"] * max(1.0, abs(ref)), (r["loss"], ref)


def _ep_reference(rank, world_size, state_path):
    import torch

    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.model.diffusiongemma.tiny import redraw_weights
    from megatron.core import parallel_state as mpu
    from tests.test_diffusiongemma_ep import _batch, _config

    install_cpu_compat()
    mpu.initialize_model_parallel()
    gpt, model = _model(_config())
    redraw_weights(gpt, seed=0)
    model.train()
    tokens, loss_mask, index = _batch()
    out = model(tokens, loss_mask, index)
    torch.save({k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}, state_path)
    return out.loss.item()


# ---- the GPU scripts' own code: a CPU tensor beside CUDA ones fails as on a GPU ---------------------
def _kernels_rank(rank, world_size, out, head_dim):
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
    import check_kernels

    return check_kernels.main(["--device", "cuda", "--dtype", "bfloat16", "--lengths", "64", "--block-size", "16",
                               "--heads", "2", "--groups", "1", "--head-dim", str(head_dim), "--math-max-rows", "64",
                               "--kernels", "tiled", "--no-timing", "--out", out])


def test_check_kernels_mask_is_on_the_kernels_device(tmp_path):
    """tests/gpu/check_kernels.py on (shaped) CUDA in bf16: its block-diffusion mask must reach the
    kernels on the CUDA device; before the fix the tiled kernel's masked_fill_ mixed the CPU mask
    with CUDA scores, which CUDA refuses."""
    r = cuda_shaped.run(_kernels_rank, 1, str(tmp_path / "k.json"), 16)[0]
    cells = r["cases"][0]["kernels"]
    assert r["ok"] and r["failed"] == [], r["failed"]
    assert cells["tiled"]["fwd"]["ok"] and cells["tiled"]["bwd"]["ok"] and cells["math"]["fwd"]["ok"]


# ---- the kernel each layer takes on CUDA (attention/kernels/capability.py) --------------------------
def _wide_layer_rank(rank, world_size):
    import torch
    from megatron.core import parallel_state as mpu

    from megatron_csbp.attention.kernels import capability, registry
    from megatron_csbp.layout.layout import SequenceLayout
    from megatron_csbp.layout.masks import BlockGeometry
    from megatron_csbp.model.diffusiongemma import diffusion_gemma_model
    from megatron_csbp.model.diffusiongemma.sft import DiffusionGemmaSFTModel
    from megatron_csbp.model.diffusiongemma.tiny import tiny_megatron_config
    from megatron_csbp.objectives.diffusiongemma_sft import DiffusionGemmaSFTObjective
    from tests.test_diffusiongemma_ep import B, L, V, _batch

    mpu.initialize_model_parallel()
    # DiffusionGemma's head dims: 128 on the sliding layers, 512 on the full (global) ones
    config = tiny_megatron_config(sliding_window=3, kv_channels=128, full_kv_channels=512, params_dtype=torch.bfloat16,
                                  bf16=True)
    calls = []
    tiled = registry.KERNELS["tiled"]

    def flex_on_this_device(q, k, v, mask, scale):  # no CUDA kernel runs here: Flex's numbers by the tiled kernel
        calls.append(("flex", q.shape[-1]))
        return tiled(q, k, v, mask, scale)

    def recorded_tiled(q, k, v, mask, scale):
        calls.append(("tiled", q.shape[-1]))
        return tiled(q, k, v, mask, scale)

    registry.KERNELS.update(flex=flex_on_this_device, tiled=recorded_tiled)
    gpt = diffusion_gemma_model(config, V, 64)  # --attention-kernel auto
    model = DiffusionGemmaSFTModel(gpt, DiffusionGemmaSFTObjective(B, V, seed=7),
                                   SequenceLayout(BlockGeometry(L, B, "token_causal"))).cuda()
    tokens, loss_mask, index = _batch()
    out = model(tokens.cuda(), loss_mask.cuda(), index)
    out.loss.backward()
    explicit = []
    for name in ("flex", "flash"):
        try:
            capability.choose(name, torch.device("cuda"), 512, torch.bfloat16)
        except ValueError as exc:
            explicit.append(str(exc))
    return {"calls": sorted(set(calls)), "logged": sorted(capability._LOGGED), "loss": out.loss.item(),
            "explicit": explicit, "grad_device": str(next(gpt.parameters()).grad.device)}


def test_a_512_wide_layer_takes_the_tiled_kernel_on_cuda():
    """A DiffusionGemma-like model in bf16 on (shaped) CUDA, --attention-kernel auto: its 128-wide
    sliding layers take Flex, its 512-wide global layers the tiled kernel (Flex's CUDA templates are
    not proven past 256), forward and backward; one log line per distinct choice (an autograd
    run and a no-grad pass are distinct); an explicit
    kernel that cannot run 512 is refused naming the flag."""
    import math

    r = cuda_shaped.run(_wide_layer_rank, 1)[0]
    assert r["calls"] == [("flex", 128), ("tiled", 512)], r["calls"]
    # the self-conditioning pass runs without gradients: its choices are lines of their own
    assert r["logged"] == sorted(
        [f"attention kernel: flex for head dim 128, bfloat16, cuda{b} (--attention-kernel auto)" for b in ("", " with backward")]
        + [f"attention kernel: tiled for head dim 512, bfloat16, cuda{b} (--attention-kernel auto)" for b in ("", " with backward")]
        + [f"attention kernel: flex runs head dims up to 256 {w} backward, not 512; next choice" for w in ("with", "without")])
    assert math.isfinite(r["loss"]) and r["grad_device"].startswith("cuda")
    assert r["explicit"] == [
        "--attention-kernel flex runs head dims up to 256 with backward, not 512 (head dim 512, bfloat16, cuda): "
        "use --attention-kernel auto or tiled",
        "--attention-kernel flash runs head dims up to 256 with backward, not 512 (head dim 512, bfloat16, cuda): "
        "use --attention-kernel auto or tiled"]
