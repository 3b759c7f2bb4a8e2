"""Gated DeltaNet layers in a block diffusion LM: the chunked rule, the layer against the per-block
brute force (float64, forward and backward), and megatron-core's own GDN forward."""
import pytest
import torch

from megatron_csbp.attention.block_attention import plan_for_layout
from megatron_csbp.attention.plan_handles import plan_mask
from megatron_csbp.attention.gated_delta import chunk_rule, recurrent_rule
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry
from tests.gdn_helpers import delta_rule_oracle, gdn_config, per_block_oracle, randomize_gdn, reference_gdn


@pytest.mark.parametrize("T", [1, 5, 16])
def test_chunk_rule_equals_token_recurrence_float64(T):
    g = torch.Generator().manual_seed(T)
    N, H, dk, dv = 2, 3, 4, 5
    q, k = torch.randn(N, H, T, dk, generator=g, dtype=torch.float64), torch.randn(N, H, T, dk, generator=g, dtype=torch.float64)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(N, H, T, dv, generator=g, dtype=torch.float64)
    logdecay = -torch.rand(N, H, T, generator=g, dtype=torch.float64) * 3
    beta = torch.rand(N, H, T, generator=g, dtype=torch.float64)
    s0 = torch.randn(N, H, dk, dv, generator=g, dtype=torch.float64)
    o1, s1 = chunk_rule(q, k, v, logdecay, beta, s0)
    o2, s2 = recurrent_rule(q, k, v, logdecay, beta, s0)
    o3, s3 = delta_rule_oracle(q, k, v, logdecay, beta, s0)  # the rule's definition, written in the test
    for o, s in ((o1, s1), (o2, s2)):
        assert (o - o3).abs().max() < 1e-12 and (s - s3).abs().max() < 1e-12


def _layer(dtype, seed=0, **overrides):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_csbp.model.hybrid import gated_delta_net_spec

    layer = build_module(gated_delta_net_spec(), config=gdn_config(dtype=dtype, **overrides), layer_number=1,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    randomize_gdn(layer, seed)
    return layer.to(dtype)


@pytest.mark.parametrize("canvas", [0, 2])
def test_layer_equals_per_block_brute_force_float64(megatron_single_rank, canvas):
    L, B, b = 24, 4, 2
    layer = _layer(torch.float64)
    layout = SequenceLayout(BlockGeometry(L, B), canvas_start=canvas)
    plan = plan_for_layout(layout)
    rows = plan.local
    x = torch.randn(len(rows), b, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    w = torch.randn(len(rows), b, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got, _ = layer(x, plan_mask(plan))
    want = per_block_oracle(layer, x, rows, B)
    assert (got - want).abs().max() < 1e-11
    params = [x] + list(layer.parameters())
    g1 = torch.autograd.grad((got * w).sum(), params)
    g2 = torch.autograd.grad((want * w).sum(), params)
    for a, r in zip(g1, g2):
        assert (a - r).abs().max() <= 1e-10 * max(1.0, float(r.abs().max()))


def test_clean_rows_match_megatron_gated_delta_net_forward(megatron_single_rank, monkeypatch):
    """megatron-core's own GatedDeltaNet.forward (deterministic mode: its torch chunked rule, fp32)
    on the clean sequence gives the clean rows. FLA (CUDA-only) is not installed, so the l2norm that
    megatron-core imports from it is transformers' FLA-aligned torch copy (Qwen3-Next's `l2norm`),
    not the plugin's."""
    import sys

    from megatron.core.ssm import gated_delta_net as mc

    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

    L, B = 16, 4
    layer = _layer(torch.float32, deterministic_mode=True)
    # The global l2norm of every module holding GatedDeltaNet's code (0.16.1: the module
    # ssm.gated_delta_net; 0.19: the package's gdn and common modules), which reads FLA's l2norm
    # (without FLA: unset in 0.16.1, None in 0.19).
    for m in {sys.modules[c.__module__] for c in mc.GatedDeltaNet.__mro__ if c.__module__.startswith(mc.__name__)}:
        monkeypatch.setattr(m, "l2norm", qwen3_next.l2norm, raising=False)
    plan = plan_for_layout(SequenceLayout(BlockGeometry(L, B)))
    x = torch.randn(len(plan.local), 1, 32, generator=torch.Generator().manual_seed(3))
    got, _ = layer(x, plan_mask(plan))
    with torch.no_grad():
        ref, _ = mc.GatedDeltaNet.forward(layer, x[L:], None)
    # fp32 error model: O(10) roundings of O(1) values per output, amplified by the 16-token
    # recurrence: ~1e-5; the bound is 20x that.
    assert (got[L:] - ref).abs().max() < 2e-4, float((got[L:] - ref).abs().max())
    assert (got[L:] - reference_gdn(layer.double(), x[L:].double()).float()).abs().max() < 2e-4


def test_partial_noisy_blocks_are_refused_by_name():
    from megatron_csbp.attention.block_attention import AttentionPlan
    from megatron_csbp.attention.gated_delta import build_routes
    from megatron_csbp.layout.masks import RowMeta

    plan = AttentionPlan(BlockGeometry(16, 4), RowMeta.of(torch.arange(2, 6), torch.arange(8)))
    with pytest.raises(ValueError, match="whole noisy blocks.*--block-size"):
        build_routes(plan, 4)


def test_layer_pattern_from_the_checkpoint():
    from megatron_csbp.model.hybrid import linear_attention_pattern

    assert linear_attention_pattern(8, full_attention_interval=4) == [1, 1, 1, 0, 1, 1, 1, 0]
    assert linear_attention_pattern(3, layer_types=["linear_attention", "full_attention", "linear_attention"]) == [1, 0, 1]
    assert linear_attention_pattern(4, linear_attention_freq=2) == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="sliding_attention"):
        linear_attention_pattern(1, layer_types=["sliding_attention"])
