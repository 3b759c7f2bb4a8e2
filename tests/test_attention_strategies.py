"""The exchange-strategy registry: one strategy per (exchange, transport, layer kind), chosen when
the `AttentionPlan` is built. The numerics of each strategy are the layout tests'
(test_block_attention_distributed, test_window_exchange, test_kv_source_exchange)."""
import pytest
import torch

from megatron_csbp.attention import strategies
from megatron_csbp.attention.block_attention import AttentionPlan, plan_for_layout
from megatron_csbp.attention.transports import TRANSPORTS
from megatron_csbp.layout.layout import SequenceLayout
from megatron_csbp.layout.masks import BlockGeometry, RowMeta

# exchange -> (full-attention layers, sliding-window layers) per transport
EXPECTED = {
    ("none", "allgather"): ("NoExchange", "NoExchange"),
    ("none", "ring"): ("NoExchange", "NoExchange"),
    ("clean", "allgather"): ("CleanAllGather", "CleanWindowed"),
    ("clean", "ring"): ("CleanRing", "CleanWindowed"),
    ("all", "allgather"): ("FullAllGather", "FullAllGather"),
    ("all", "ring"): ("FullRing", "FullRing"),
}


def test_every_exchange_and_transport_has_one_strategy_per_layer_kind():
    assert set(TRANSPORTS) == {"allgather", "ring"}
    for (exchange, transport), (full, windowed) in EXPECTED.items():
        assert type(strategies.select_strategy(exchange, transport, False)).__name__ == full
        assert type(strategies.select_strategy(exchange, transport, True)).__name__ == windowed
    assert {key[:2] for key in strategies._STRATEGIES} == set(EXPECTED)
    # Only the clean exchange moves a K/V source (the CP baseline stands for Megatron's CP).
    for (exchange, transport, windowed), strategy in strategies._STRATEGIES.items():
        assert strategy.moves_kv_source == (exchange == "clean")


def test_the_plan_chooses_its_strategies_once():
    geometry = BlockGeometry(16, 4)
    plan = plan_for_layout(SequenceLayout(geometry), 0)
    assert isinstance(plan.strategy, strategies.NoExchange) and plan.strategy_for(None) is plan.strategy
    assert plan.strategy_for(5) is plan.window_strategy
    rows = RowMeta.of(torch.tensor([], dtype=torch.long), torch.arange(16))
    with pytest.raises(ValueError, match="--attention-transport must be one of"):
        AttentionPlan(geometry, rows, "clean", "pipeline", group=object(), peers=[rows], members=[rows])


def test_a_key_is_served_once():
    with pytest.raises(ValueError, match="already served"):
        @strategies.register("clean", ["ring"], [False])
        class Another(strategies.NoisyThenClean):
            pass
    assert type(strategies.select_strategy("clean", "ring", False)).__name__ == "CleanRing"


@pytest.mark.parametrize("kernel", ["cpu_flash", "tiled"])
def test_attention_keeps_no_view_of_the_fused_qkv_output(kernel):
    """Megatron's q, k, v are views of one fused projection output [rows, b, G, (H/G + 2) d]. A
    kernel saving v for backward (the local partial of single, BP and CSBP's ring) kept that whole
    output alive until backward: (H/G + 2)x v's bytes per layer, CSBP-ring's excess peak memory
    over CP's. The call copies such views; nothing it saves for backward shares their storage,
    and the result is the one of the views themselves."""
    from megatron_csbp.attention.block_attention import block_diffusion_attention
    from megatron_csbp.attention.kernels.registry import get_kernel

    L, B, H, G, d = 64, 8, 4, 2, 8
    plan = plan_for_layout(SequenceLayout(BlockGeometry(L, B)), 0)
    gen = torch.Generator().manual_seed(3)
    fused = torch.randn(2 * L, 1, G, (H // G + 2) * d, generator=gen, dtype=torch.float64, requires_grad=True)
    q, k, v = fused.split([H // G * d, d, d], dim=3)  # as Megatron's SelfAttention splits it
    q = q.reshape(2 * L, 1, H, d)
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block_diffusion_attention(q, k, v, plan, softmax_scale=d ** -0.5, kernel=get_kernel(kernel, "cpu"))
    assert saved and fused.untyped_storage().data_ptr() not in saved
    # same values as on contiguous copies, gradients reach the fused tensor
    ref = block_diffusion_attention(*(x.detach().contiguous() for x in (q, k, v)), plan, softmax_scale=d ** -0.5,
                                    kernel=get_kernel(kernel, "cpu"))
    assert torch.equal(out, ref)
    out.sum().backward()
    assert fused.grad is not None and bool(fused.grad.abs().sum() > 0)


def test_csbp_plan_keeps_one_copy_of_the_ring_rows():
    """A CSBP ring member's clean shard is the tail of its rows ([noisy ; clean]): the plan takes it
    as a view (`_clean_tail`), the same rows, no second copy of their metadata; rows that do not
    end with the shard (two clean rings: a member holds more) keep the shard as given."""
    from megatron_csbp.attention.block_attention import _clean_tail

    layout = SequenceLayout(BlockGeometry(256, 8), 4, 4)
    for r in range(4):
        member, shard = layout.rows(r), layout.ring_clean_rows(0)[r]
        tail = _clean_tail(member, shard)
        assert torch.equal(tail.position, shard.position) and bool(tail.is_clean.all())
        assert tail.position.untyped_storage().data_ptr() == member.position.untyped_storage().data_ptr()
    two_rings = SequenceLayout(BlockGeometry(256, 8), 2, 4)
    member, shard = two_rings.rows(0), two_rings.ring_clean_rows(0)[1]
    assert _clean_tail(member, shard) is shard


def test_gathered_clean_rows_are_attended_in_position_order():
    """CSBP's all-gathered clean rows come shard by shard; `plan.gathered_runs` puts them in position
    order (at most 2 runs per ring member, slices only), so every clean prefix is one run of keys
    and the cpu_flash kernel makes as many calls on every rank (in ring order the rank holding the
    last blocks made 86 calls per layer at L = 1024, P = 4, the one holding the middle 33)."""
    from megatron_csbp.attention.kernels.cpu_flash import cpu_flash_plan
    from megatron_csbp.layout.rows import PartialMask

    L, B, P = 1024, 16, 4
    geometry = BlockGeometry(L, B)
    layout = SequenceLayout(geometry, P, P)
    calls = []
    for r in range(P):
        local = layout.rows(r)
        plan = AttentionPlan(geometry, local, "clean", "allgather", object(), layout.ring_clean_rows(r),
                             [layout.rows(i) for i in range(P)], r)
        runs = plan.gathered_runs()
        gathered = RowMeta.cat(plan.peers)
        ordered = torch.cat([gathered.position[s] for s in runs])
        assert all(isinstance(s, slice) for s in runs) and len(runs) <= 2 * P
        assert torch.equal(ordered, torch.arange(L))  # every clean row once, in position order
        n = plan.num_noisy
        keys = RowMeta.cat([local.select(slice(0, n))] + [gathered.select(s) for s in runs])
        calls.append(cpu_flash_plan(PartialMask.of(local, keys, geometry)).flash_calls)
    assert max(calls) - min(calls) <= 1, calls
