"""GPU equivalence of the block-aware attention (FlexAttention path) in bf16 against the dense
reference (materialized 2L x 2L mask, fp32 math), forward and backward, for every mask variant.

Runs only with CUDA: `pytest tests/gpu/test_gpu_equivalence.py` (tests/gpu/run_all.sh runs it).
"""
import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from megatron_csbp.attention.block_attention import plan_for_layout, block_diffusion_attention  # noqa: E402
from megatron_csbp.attention.kernels.registry import get_kernel  # noqa: E402
from megatron_csbp.layout.layout import SequenceLayout  # noqa: E402
from megatron_csbp.layout.masks import BlockGeometry, dense_reference_mask  # noqa: E402

CASES = [
    # L, B, clean attention, window, heads, kv groups, head dim
    (512, 32, "block_causal", None, 8, 2, 64),
    (1024, 64, "block_causal", None, 16, 4, 128),
    (1024, 64, "token_causal", None, 16, 4, 128),
    (1024, 32, "token_causal", 128, 8, 8, 128),
    (2048, 128, "block_causal", 256, 8, 2, 128),
]


def _dense_mask_fast(L, B, clean_attention, window):
    # the rule-table oracle is an O(L^2) Python loop: build it vectorised from the same rules
    pos = torch.arange(2 * L) % L
    clean = torch.arange(2 * L) >= L
    blk = pos // B
    qn, kn = ~clean[:, None], ~clean[None, :]
    qc, kc = clean[:, None], clean[None, :]
    nn_ = qn & kn & (blk[:, None] == blk[None, :])
    nc = qn & kc & (blk[None, :] < blk[:, None])
    if clean_attention == "block_causal":
        cc = qc & kc & (blk[None, :] <= blk[:, None])
    else:
        cc = qc & kc & (pos[None, :] <= pos[:, None])
    if window is not None:
        nc &= pos[None, :] >= blk[:, None] * B - (window - 1)
        cc &= pos[None, :] > pos[:, None] - window
    return nn_ | nc | cc


def _dense_attention(q, k, v, mask, scale):
    """fp32 softmax attention over the materialised [2L, 2L] mask (the reference; GQA by repeat)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v)


def test_fast_oracle_matches_rule_table():
    for L, B, ca, w in [(64, 8, "block_causal", None), (64, 8, "token_causal", 12), (48, 16, "block_causal", 20), (32, 8, "token_causal", None)]:
        assert torch.equal(_dense_mask_fast(L, B, ca, w), dense_reference_mask(L, B, ca, w))


@needs_cuda
@pytest.mark.parametrize("L,B,clean_attention,window,H,G,d", CASES)
def test_flex_bf16_matches_dense_reference(L, B, clean_attention, window, H, G, d):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    geometry = BlockGeometry(L, B, clean_attention, window)
    plan = plan_for_layout(SequenceLayout(geometry, 1, 1))
    q = torch.randn(2 * L, 1, H, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2 * L, 1, G, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2 * L, 1, G, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2 * L, 1, H, d, device=dev, dtype=torch.bfloat16)
    scale = d ** -0.5
    out = block_diffusion_attention(q, k, v, plan, softmax_scale=scale, kernel=get_kernel("flex", dev), window=window)
    out.backward(grad)
    got = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]

    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    mask = _dense_mask_fast(L, B, clean_attention, window).to(dev)
    ref = _dense_attention(q32, k32, v32, mask, scale)
    ref.backward(grad.float())
    want = [ref, q32.grad, k32.grad, v32.grad]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a - b).abs().max().item()
        tol = 2e-2 * max(1.0, b.abs().max().item())
        assert err <= tol, f"{name}: max error {err:.3e} > {tol:.3e} (L={L}, B={B}, {clean_attention}, W={window})"
