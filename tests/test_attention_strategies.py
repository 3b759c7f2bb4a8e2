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
