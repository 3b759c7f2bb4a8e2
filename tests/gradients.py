"""The gradient comparison the layout-vs-one-rank tests report and bound, and their error model.

The layout-vs-one-rank exactness tests build their models with `params_dtype=EXACT_DTYPE`
(float64; reductions, softmaxes and norms then run in float64 too: `utils.precision`). A layout only
reorders sums (attention partials merged over key chunks, gradients all-reduced over ranks, K/V
gradients reduce-scattered) and evaluates elementwise functions at other positions of a vector
(whose last bit can depend on that position). With u64 = 2^-53 = 1.1e-16, each reordered sum of K
terms moves by <= K * u64 relative and D layers compound it, ~ D * K * u64 < 1e-12 for the tiny
models here (K <= 10^3, D <= 10); a per-tensor ratio max|g - r| / max|r| can lose another
max|r| / typical|r| <= 10^2. FP64_TOL leaves >= 10^2 over that model and >= 10^3 over every
deviation measured under ATEN_CPU_CAPABILITY = default, avx2 and avx512 (docs/exactness.md).

DiffusionGemma's MoE router is the one place megatron-core keeps fp32 in an fp64 model: the top-k
softmax is hard-coded `torch.softmax(..., dtype=torch.float32)` (value and backward) in
`megatron.core.transformer.moe.moe_utils.topk_routing_with_score_function`. Routing weights then
carry u32 = 2^-24 = 6e-8 rounding whose last bit depends on the layout (vectorised exp over
another row count), so router-parameter gradients move by ~u32 relative, the other gradients by the
router's share of the backward flow (~10^-2 u32 in norm), the loss by ~u32 x routing-weight share
of the output. MOE_TOL bounds those by 33 x u32 (worst per tensor: a tensor's entries are sums
over tokens with partial cancellation, measured up to 2 u32), u32 (norm) and u32 / 10 (loss): >= 10x
the largest deviation measured, and 15 to 500 times tighter than the fp32 tolerances these tests
had.
"""
import torch

# The dtype of the layout-vs-one-rank exactness tests (models built with params_dtype=EXACT_DTYPE).
EXACT_DTYPE = torch.float64
# Relative bounds: loss |l - l1| / max(1, |l1|); rel_norm |g - g1| / |g1| over all parameters;
# worst max over tensors of max|g - g1| / max|g1|.
FP64_TOL = dict(loss=1e-12, rel_norm=1e-10, worst=1e-9)
MOE_TOL = dict(loss=6e-9, rel_norm=6e-8, worst=2e-6)


def gradient_error(pairs):
    """(worst, rel_norm) over (got, reference) gradient tensors: worst = the largest
    max|g - r| / max|r| of one tensor (max|r| floored at 1e-6); rel_norm = |g - r| / |r| over all
    tensors together."""
    worst, diff2, ref2 = 0.0, 0.0, 0.0
    for g, r in pairs:
        worst = max(worst, float((g - r).abs().max() / r.abs().max().clamp_min(1e-6)))
        diff2, ref2 = diff2 + float((g - r).pow(2).sum()), ref2 + float(r.pow(2).sum())
    return worst, (diff2 / ref2) ** 0.5


def one_rank_reference(model, gpt, batches, denominator):
    """The reference of the pipeline tests: `model` (a whole `BlockDiffusionModel` of `gpt`) over
    `batches` (dicts: tokens, loss_mask, sample_index) one after the other, gradients accumulated;
    (summed loss, {parameter name: gradient}, zeros where a parameter got none)."""
    loss = 0.0
    for b in batches:
        out = model(b["tokens"], b["loss_mask"], b["sample_index"], denominator)
        out.loss.backward()
        loss += float(out.loss.detach())
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone()) for n, p in gpt.named_parameters()}
    return loss, grads


def pipeline_forward_step(denominator, losses: list):
    """megatron-core's `forward_step_func` for the pipeline tests: a chunk's forward on the next
    micro-batch (with the first stage's self-conditioning input when the batch carries one); the
    last stage appends its partial loss to `losses`."""

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        sc = {"self_conditioning": b.pop("self_conditioning")} if "self_conditioning" in b else {}
        out = model(b["tokens"], b["loss_mask"], b["sample_index"], denominator, **sc)
        if isinstance(out, torch.Tensor):
            return out, None

        def loss_func(output_tensor):
            losses.append(float(out.loss.detach()))
            return output_tensor, out.num_targets.to(torch.int), {}
        return out.loss, loss_func
    return forward_step


def check_close(loss, ref_loss, worst, rel_norm, tol, what=""):
    """Assert one layout's loss and gradient errors are within `tol` (FP64_TOL or MOE_TOL)."""
    loss_err = abs(loss - ref_loss) / max(1.0, abs(ref_loss))
    assert loss_err <= tol["loss"], (what, "loss", loss, ref_loss, loss_err)
    assert rel_norm <= tol["rel_norm"], (what, "rel_norm", rel_norm)
    assert worst <= tol["worst"], (what, "worst", worst)


def gather_tensor_parallel(t, param, group):
    """The full (TP = 1) tensor of a TP-sharded parameter's value or gradient `t`: the shards of
    every TP rank concatenated along `param.partition_dim`, interleaved per `partition_stride` (a
    SwiGLU fc1 holds [gate_r; up_r] on rank r: stride 2 gives [gate_0; gate_1; up_0; up_1])."""
    import torch.distributed as dist

    tp = dist.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
    if stride > 1:
        chunks = [c for part in parts for c in torch.chunk(part, stride, dim=dim)]
        parts = [chunks[r * stride + s] for s in range(stride) for r in range(tp)]
    return torch.cat(parts, dim=dim)


def tp_slice(full, param, tp_rank):
    """This TP rank's shard of a full tensor as the parameter holds it (the inverse of
    `gather_tensor_parallel`; SwiGLU's linear_fc1: stride 2, the rank's slice of each of [gate ; up])."""
    if full.shape == param.shape:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    size = param.shape[dim] // stride
    return torch.cat([part.narrow(dim, tp_rank * size, size) for part in full.chunk(stride, dim)], dim)
